"""RECALL end to end on generated tiny causal LMs: the per-layer weights are recomputed here
from an independent forward pass (transformers) and a numpy CKA, and the merged tensors are
checked against W_base + Σ α_{l,i}·Δ_i."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import merge_reference as M
import numpy as np
import pytest
import torch
from conftest import REPO, f64, load_dir
from reference import rel

from dghard_cli.engine.writer import RunOptions
from dghard_cli.errors import InputError
from dghard_cli.merging import MergeOptions, merge
from dghard_cli.methods import calibration
from dghard_cli.methods import recall as R
from dghard_cli.methods.calibration import RecallOptions, load_pool
from dghard_cli.testing.synthetic import ArchConfig, make_pair

transformers = pytest.importorskip("transformers")

CFG = ArchConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=3, vocab_size=256)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    root = tmp_path_factory.mktemp("recall")
    base, ft1 = make_pair(root / "a", CFG, ft_shards=2, seed=2)
    _, ft2 = make_pair(root / "b", CFG, ft_shards=1, seed=2, delta_seed=3)
    return {"root": root, "base": base, "fts": [ft1, ft2]}


def hidden_rows(path, texts: list[str], max_tokens: int) -> list[np.ndarray]:
    """Token-level hidden states per group (embedding output, each layer), straight from transformers."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    groups = None
    with torch.no_grad():
        for text in texts:
            ids = [b % CFG.vocab_size for b in text.encode("utf-8")][:max_tokens]
            hs = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
            groups = groups or [[] for _ in hs]
            for g, h in enumerate(hs):
                groups[g].append(h[0].double().numpy())
    return [np.concatenate(rows) for rows in groups]


def check_merged(lm, doc, out, n):
    """The merged tensors: layer by layer, W_base + Σ α_i Δ_i with the reported weights."""
    weights = {layer["group"]: layer["weights"] for layer in doc["recall"]["layers"]}
    base = load_dir(lm["base"])
    fts = [load_dir(p) for p in lm["fts"][:n]]
    merged = load_dir(out)
    for name, b in base.items():
        alpha = weights[R.tensor_group(name, CFG.num_hidden_layers)]
        ref = f64(b) + sum(a * (f64(f[name]) - f64(b)) for a, f in zip(alpha[1:], fts, strict=True))
        assert rel(f64(merged[name]), ref) <= 1e-6, name
    return weights


def test_recall_end_to_end_two_finetunes(lm, tmp_path):
    n = 2
    out = tmp_path / "recalled"
    opts = MergeOptions(method="recall", run=RunOptions(device="cpu", quiet=True))
    doc = merge(lm["base"], lm["fts"][:n], out, opts)
    rc = doc["recall"]
    assert rc["kernel"] == "linear-cka" and rc["pooling"] == "token" and rc["temperature"] == 0.05
    assert "built-in" in rc["calibration"]["source"]
    assert rc["tokens"].startswith("utf-8 bytes modulo the vocabulary size (256)")
    assert len(rc["selected_samples"]) == 8 and rc["calibration"]["pool"] > 8
    groups = [layer["group"] for layer in rc["layers"]]
    assert groups == ["embed", "layer.0", "layer.1", "layer.2"]

    # independent recomputation of every similarity and weight
    pool, _ = load_pool(None)
    texts = [pool[i] for i in rc["selected_samples"]]
    paths = [lm["base"], *lm["fts"][:n]]
    feats = [hidden_rows(p, texts, 64) for p in paths]
    for g, layer in enumerate(rc["layers"]):
        sim = np.eye(n + 1)
        for a in range(n + 1):
            for b in range(a + 1, n + 1):
                sim[a, b] = sim[b, a] = M.linear_cka(feats[a][g], feats[b][g])
        assert np.allclose(layer["similarity"], sim, rtol=0, atol=1e-6)
        alpha = np.mean([M.softmax(sim[:, r] / 0.05) for r in range(1, n + 1)], axis=0)
        assert np.allclose(layer["weights"], alpha, rtol=0, atol=1e-6)
    weights = check_merged(lm, doc, out, n)
    by_name = {r["name"]: r for r in doc["tensors"]}
    assert by_name["model.layers.2.mlp.up_proj.weight"]["recall_group"] == "layer.2"
    assert by_name["model.embed_tokens.weight"]["recall_group"] == "embed"
    assert by_name["lm_head.weight"]["recall_group"] == "layer.2"
    assert by_name["model.norm.weight"]["recall_weights"] == weights["layer.2"]
    written = json.loads((out / "dghard_report.json").read_text())
    assert written["recall"]["layers"] == rc["layers"]


def test_recall_checks_out_once(lm, tmp_path, monkeypatch):
    """OUT is checked before the forward passes, and not again when the merge is written (three
    times before the one writer)."""
    from conftest import count_out_checks

    calls = count_out_checks(monkeypatch)
    opts = MergeOptions(method="recall", run=RunOptions(device="cpu", quiet=True))
    merge(lm["base"], lm["fts"][:1], tmp_path / "o", opts)
    assert calls == [str(tmp_path / "o")]


def test_recall_one_finetune(lm, tmp_path):
    """One fine-tune: α_ft = 1 / (1 + exp((K(base, ft) − 1)/T)) per layer, in [½, 1)."""
    out = tmp_path / "o"
    opts = MergeOptions(
        method="recall",
        recall=RecallOptions(select="first", samples=3, max_tokens=32, temperature=0.02),
        run=RunOptions(device="cpu", quiet=True),
    )
    doc = merge(lm["base"], lm["fts"][:1], out, opts)
    for layer in doc["recall"]["layers"]:
        k = layer["similarity"][0][1]
        assert 0 < k < 1
        assert layer["weights"][1] == pytest.approx(1 / (1 + np.exp((k - 1) / 0.02)), abs=1e-12)
        assert 0.5 <= layer["weights"][1] < 1
    check_merged(lm, doc, out, 1)


def test_one_model_in_memory_at_a_time(lm, tmp_path, monkeypatch):
    alive, peak = [0], [0]
    load, release = calibration._load_model, calibration._release

    def counting_load(path, device):
        alive[0] += 1
        peak[0] = max(peak[0], alive[0])
        return load(path, device)

    def counting_release(model, device):
        alive[0] -= 1
        release(model, device)

    monkeypatch.setattr(calibration, "_load_model", counting_load)
    monkeypatch.setattr(calibration, "_release", counting_release)
    opts = MergeOptions(
        method="recall",
        recall=RecallOptions(kernel="rbf-cka", pooling="mean", select="first", samples=4, temperature=0.5),
        run=RunOptions(device="cpu", quiet=True),
    )
    doc = merge(lm["base"], lm["fts"], tmp_path / "o", opts)
    assert peak[0] == 1 and alive[0] == 0
    assert doc["recall"]["selected_samples"] == [0, 1, 2, 3]
    assert doc["recall"]["rows_per_model"] == 4  # mean pooling: one row per sample
    assert doc["parameters"]["kernel"] == "rbf-cka"


def test_calib_jsonl(lm, tmp_path):
    calib = tmp_path / "c.jsonl"
    calib.write_text(
        json.dumps("The first sample.") + "\n\n" + json.dumps({"text": "A second one, longer."}) + "\n"
    )
    opts = MergeOptions(method="recall", calib=calib, run=RunOptions(device="cpu", quiet=True))
    doc = merge(lm["base"], lm["fts"][:1], tmp_path / "o", opts)
    assert doc["recall"]["calibration"]["pool"] == 2
    assert doc["recall"]["selected_samples"] == [0, 1]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "no text key"}\n')
    with pytest.raises(InputError, match="line 1"):
        merge(lm["base"], lm["fts"][:1], tmp_path / "o2", MergeOptions(method="recall", calib=bad))
    assert not (tmp_path / "o2").exists()


def test_missing_transformers_is_a_clear_exit_2(lm, tmp_path):
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "from dghard_cli.cli import entrypoint\n"
        f"sys.argv = ['dghard', 'merge', '--method', 'recall', {str(lm['base'])!r}, {str(lm['fts'][0])!r},"
        f" '--out', {str(tmp_path / 'o')!r}]\n"
        "entrypoint()\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1 and "pip install 'dghard[recall]'" in res.stderr
    assert not (tmp_path / "o").exists()


def test_select_typical_takes_one_per_cluster():
    rng = np.random.default_rng(0)
    centers = np.array([[0, 0], [10, 0], [0, 10], [10, 10]], dtype=float)
    pts = np.concatenate([c + 0.1 * rng.standard_normal((5, 2)) for c in centers])
    chosen = R.select_typical(pts, 4)
    assert sorted({i // 5 for i in chosen}) == [0, 1, 2, 3]
    for i in chosen:  # the member nearest its cluster's mean
        members = pts[(i // 5) * 5 : (i // 5) * 5 + 5]
        assert np.argmin(np.sum((members - members.mean(0)) ** 2, 1)) == i % 5
    assert R.select_typical(pts, 30) == list(range(20))


def test_kernels_against_references():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((40, 8))
    y = x @ rng.standard_normal((8, 8)) + 0.5 * rng.standard_normal((40, 8))
    assert R.linear_cka(x, y) == pytest.approx(M.linear_cka(x, y), abs=1e-12)
    wide_x, wide_y = rng.standard_normal((10, 30)), rng.standard_normal((10, 30))
    assert R.linear_cka(wide_x, wide_y) == pytest.approx(M.linear_cka(wide_x, wide_y), abs=1e-12)
    assert R.linear_cka(x, 3 * x + 1) == pytest.approx(1.0, abs=1e-12)  # invariant to scale and shift
    assert R.rbf_cka(x, x) == pytest.approx(1.0, abs=1e-12)
    assert 0 < R.rbf_cka(x, y) < 1
    assert R.cosine_rows(x, -x) == pytest.approx(-1.0)
    assert R.tensor_group("model.layers.7.self_attn.q_proj.weight", 4) == "layer.3"
    assert R.tensor_group("transformer.h.2.mlp.c_fc.weight", 4) == "layer.2"
    assert R.tensor_group("transformer.wte.weight", 4) == "embed"
    assert R.tensor_group("lm_head.weight", 4) == "layer.3"
