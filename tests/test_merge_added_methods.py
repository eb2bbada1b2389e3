"""SLERP, Model Breadcrumbs (+TIES), DELLA (+linear), Model Stock and ``normalize`` against
independent float64 numpy references (tests/merge_reference.py, mergekit 0.1.5's definitions),
on generated 2- and 3-model checkpoints (Llama tensor names, sharded); plus what the
definitions promise: exact keep counts, deterministic ties, DELLA's order-independent stream
and unbiasedness, and the same output whatever the row blocks."""

from __future__ import annotations

import dataclasses
import math

import merge_reference as M
import numpy as np
import pytest
import torch
from conftest import f64, load_dir
from reference import rel

from dghard_cli.engine.plan import PolicyOptions
from dghard_cli.engine.writer import RunOptions
from dghard_cli.errors import InputError
from dghard_cli.merging import MergeOptions, merge, resolve_parameters
from dghard_cli.methods import breadcrumbs as bc_mod
from dghard_cli.methods import della as della_mod
from dghard_cli.methods import model_stock as ms_mod
from dghard_cli.methods import slerp as slerp_mod
from dghard_cli.methods.dare import CHUNK
from dghard_cli.testing.synthetic import ArchConfig, make_pair

TOL = 1e-6
CFG = ArchConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2, vocab_size=256)


def options(**kw) -> MergeOptions:
    """MergeOptions with the added methods' parameters (``t``, ``gamma``, ...) in ``extra``."""
    fields = {f.name for f in dataclasses.fields(MergeOptions)}
    extra = {k: kw.pop(k) for k in list(kw) if k not in fields}
    return MergeOptions(**kw, extra=extra)


def run_merge(three_fine_tunes, out, method, n, **kw):
    opts = options(method=method, run=RunOptions(device="cpu", quiet=True), **kw)
    doc = merge(three_fine_tunes["base_dir"], three_fine_tunes["ft_dirs"][:n], out, opts)
    return doc, load_dir(out)


def check_all(three_fine_tunes, merged, n, ref_fn, tol=TOL):
    """Every tensor of the output against ``ref_fn(name, base, [ft...])`` (float32 arrays in)."""
    base, fts = three_fine_tunes["base"], three_fine_tunes["fts"][:n]
    assert set(merged) == set(base)
    for name, b in base.items():
        ref = ref_fn(name, b.numpy(), [f[name].numpy() for f in fts])
        e = rel(f64(merged[name]), ref)
        assert e <= tol, f"{name}: relative error {e:.2e}"


def f64s(b, fs):
    return b.astype(np.float64), [f.astype(np.float64) for f in fs]


# -- SLERP -----------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [0.0, 0.3, 0.75, 1.0])
def test_slerp(three_fine_tunes, tmp_path, t):
    doc, merged = run_merge(three_fine_tunes, tmp_path / "o", "slerp", 1, t=t)

    def ref(name, b, fs):
        b64, (f64_,) = f64s(b, fs)
        return M.ref_slerp(b64, f64_, t)

    check_all(three_fine_tunes, merged, 1, ref)
    by = {r["name"]: r for r in doc["tensors"]}
    # norms move little: nearly colinear, the linear rule; matrices here are not
    assert by["model.norm.weight"]["slerp_rule"] == "linear"
    assert by["model.layers.0.mlp.up_proj.weight"]["slerp_rule"] == "spherical"
    assert doc["merge"]["spherical_tensors"] + doc["merge"]["linear_tensors"] == len(by)
    assert doc["parameters"]["t"] == t
    if t == 0.0:
        for name, b in three_fine_tunes["base"].items():
            assert rel(f64(merged[name]), f64(b)) <= 1e-7, name


def test_slerp_in_row_blocks_and_pure_function(three_fine_tunes, tmp_path):
    _, whole = run_merge(three_fine_tunes, tmp_path / "w", "slerp", 1, t=0.4)
    _, blocks = run_merge(three_fine_tunes, tmp_path / "b", "slerp", 1, t=0.4, block_bytes=2048)
    for name in whole:
        assert rel(f64(blocks[name]), f64(whole[name])) <= 1e-7, name
    a = torch.randn(50, 40, dtype=torch.float64)
    b = torch.randn(50, 40, dtype=torch.float64)
    assert np.allclose(slerp_mod.slerp(a, b, 0.3).numpy(), M.ref_slerp(a.numpy(), b.numpy(), 0.3), atol=1e-12)
    # antipodal and colinear pairs take the linear rule; a zero tensor does not divide by zero
    assert slerp_mod.slerp_coefficients(0.3, 4.0, 4.0, -4.0)[3]
    assert slerp_mod.slerp_coefficients(0.3, 4.0, 9.0, 6.0)[:2] == (0.7, 0.3)
    z = slerp_mod.slerp(torch.zeros(5, dtype=torch.float64), torch.ones(5, dtype=torch.float64), 0.5)
    assert torch.allclose(z, torch.full((5,), math.sin(math.pi / 4), dtype=torch.float64))


def test_slerp_takes_exactly_one_finetune(three_fine_tunes, tmp_path):
    with pytest.raises(InputError, match="one fine-tune; got 2"):
        run_merge(three_fine_tunes, tmp_path / "o", "slerp", 2)
    with pytest.raises(InputError, match=r"--t must be in \[0, 1\]"):
        run_merge(three_fine_tunes, tmp_path / "o", "slerp", 1, t=1.5)
    assert not (tmp_path / "o").exists()


# -- Breadcrumbs ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["breadcrumbs", "breadcrumbs-ties"])
@pytest.mark.parametrize("n", [2, 3])
def test_breadcrumbs(three_fine_tunes, tmp_path, method, n):
    w = [1.0, 0.5, 2.0][:n]
    ties = method == "breadcrumbs-ties"
    doc, merged = run_merge(
        three_fine_tunes, tmp_path / "o", method, n, weights=w, density=0.6, gamma=0.05, lam=0.9
    )

    def ref(name, b, fs):
        b64, f64_ = f64s(b, fs)
        return M.ref_breadcrumbs(b64, f64_, w, 0.6, 0.05, 0.9, ties=ties, normalize=False)

    check_all(three_fine_tunes, merged, n, ref)
    for r in doc["tensors"]:
        numel = math.prod(r["shape"])
        assert r["kept"] == [int(0.6 * numel)] * n, r["name"]
        assert r["dropped_top"] == [min(int(0.05 * numel), numel - int(0.6 * numel))] * n
    assert ("sign_conflicts" in doc["merge"]) == ties
    assert doc["parameters"].get("normalize") is (False if ties else None)


def test_breadcrumbs_ties_normalized_and_blocks(three_fine_tunes, tmp_path):
    w = [1.0, 0.5, 2.0]
    kw = dict(weights=w, density=0.5, gamma=0.1, normalize=True)
    _, merged = run_merge(three_fine_tunes, tmp_path / "o", "breadcrumbs-ties", 3, **kw)

    def ref(name, b, fs):
        b64, f64_ = f64s(b, fs)
        return M.ref_breadcrumbs(b64, f64_, w, 0.5, 0.1, 1.0, ties=True, normalize=True)

    check_all(three_fine_tunes, merged, 3, ref)
    _, blocks = run_merge(three_fine_tunes, tmp_path / "b", "breadcrumbs-ties", 3, block_bytes=4096, **kw)
    for name in merged:
        assert torch.equal(blocks[name], merged[name]), name


def test_breadcrumbs_bf16_ties_are_deterministic(tmp_path):
    """bf16 deltas repeat magnitudes: which tied entries stay follows the documented order."""
    base, ft1 = make_pair(tmp_path / "a", CFG, dtype="bfloat16", ft_shards=2, seed=3)
    _, ft2 = make_pair(tmp_path / "b", CFG, dtype="bfloat16", ft_shards=1, seed=3, delta_seed=4)
    b, fs = load_dir(base), [load_dir(ft1), load_dir(ft2)]
    opts = options(
        method="breadcrumbs",
        density=0.3,
        gamma=0.02,
        run=RunOptions(device="cpu", quiet=True),
        policy=PolicyOptions(out_dtype="F32"),
    )
    merge(base, [ft1, ft2], tmp_path / "o", opts)
    merged = load_dir(tmp_path / "o")
    for name, t in b.items():
        ref = M.ref_breadcrumbs(
            f64(t), [f64(f[name]) for f in fs], [1.0, 1.0], 0.3, 0.02, 1.0, ties=False, normalize=False
        )
        assert rel(f64(merged[name]), ref) <= TOL, name


def test_breadcrumbs_counts():
    assert bc_mod.breadcrumbs_counts(1000, 0.9, 0.01) == (10, 900)
    assert bc_mod.breadcrumbs_counts(1000, 0.995, 0.01) == (5, 995)  # no room: fewer outliers go
    assert bc_mod.breadcrumbs_counts(1000, 1.0, 0.01) == (0, 1000)  # density 1: nothing goes
    assert bc_mod.breadcrumbs_counts(10, 0.05, 0.0) == (0, 0)  # ⌊0.5⌋: mergekit keeps none
    d = torch.tensor([5.0, -1.0, 3.0, 0.5, -4.0, 2.0], dtype=torch.float64)
    out = bc_mod.breadcrumbs(d, density=0.5, gamma=1 / 6)  # drop 5, keep -4, 3, 2
    assert out.tolist() == [0.0, 0.0, 3.0, 0.0, -4.0, 2.0]


# -- DELLA -----------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["della", "della-linear"])
@pytest.mark.parametrize("n", [2, 3])
def test_della(three_fine_tunes, tmp_path, method, n):
    w = [1.0, 0.7, 0.4][:n]
    ties = method == "della"
    doc, merged = run_merge(
        three_fine_tunes, tmp_path / "o", method, n, weights=w, density=0.4, epsilon=0.1, lam=0.9, seed=7
    )
    check_all(
        three_fine_tunes,
        merged,
        n,
        lambda name, b, fs: M.ref_della(b, fs, w, 0.4, 0.1, 0.9, 7, name, CHUNK, ties=ties, normalize=True),
    )
    kept = total = 0
    for r in doc["tensors"]:
        numel = math.prod(r["shape"])
        for k in r["kept"]:
            kept += k
            total += numel
    assert abs(kept / total - 0.4) <= 3 * math.sqrt(0.4 * 0.6 / total) + 0.002
    assert "dghard-della" in doc["parameters"]["random_stream"]


def test_della_identical_across_blocks_and_seeded(three_fine_tunes, tmp_path):
    kw = dict(density=0.5, epsilon=0.2, seed=3, normalize=False)
    _, first = run_merge(three_fine_tunes, tmp_path / "o1", "della", 3, **kw)
    _, blocks = run_merge(three_fine_tunes, tmp_path / "o2", "della", 3, block_bytes=1024, **kw)
    _, other = run_merge(three_fine_tunes, tmp_path / "o3", "della", 3, **{**kw, "seed": 4})
    for name in first:
        assert torch.equal(first[name], blocks[name]), name
    assert not torch.equal(
        first["model.layers.0.mlp.up_proj.weight"], other["model.layers.0.mlp.up_proj.weight"]
    )
    check_all(
        three_fine_tunes,
        first,
        3,
        lambda name, b, fs: M.ref_della(
            b, fs, [1.0] * 3, 0.5, 0.2, 1.0, 3, name, CHUNK, ties=True, normalize=False
        ),
    )


def test_della_is_unbiased_and_favours_large_entries():
    row = torch.arange(1, 68, dtype=torch.float64) * 0.01 * (-1.0) ** torch.arange(67)
    d = torch.stack([row, row.flip(0), -row])  # |d| ranks: 0 .. 66, the middle (rank 33) at |d| = 0.34
    seeds = 600
    total = torch.zeros_like(d)
    kept_big = kept_small = 0
    for s in range(seeds):
        out = della_mod.della(d, 0.4, 0.2, s, "w")
        total += out
        keep = out != 0
        big = d.abs() == d.abs().max()
        kept_big += int(keep[big].sum())
        kept_small += int(keep[d.abs() == 0.34].sum())
    # each entry's mean is d (std of the mean <= |d|·sqrt((1-p)/p)/sqrt(seeds))
    assert torch.all(
        (total / seeds - d).abs() <= 5 * d.abs() * math.sqrt(0.8 / 0.2) / math.sqrt(seeds) + 1e-12
    )
    assert kept_big / (3 * seeds) == pytest.approx(0.6, abs=0.05)  # the largest: density + epsilon
    assert kept_small / (3 * seeds) == pytest.approx(0.4, abs=0.05)  # the middle rank: density
    # probabilities: the smallest of a row density − ε, the largest density + ε
    p = della_mod.keep_probabilities(torch.tensor([[0.1, -3.0, 2.0]]), 0.5, 0.1)
    assert torch.allclose(p, torch.tensor([[0.4, 0.6, 0.5]], dtype=torch.float64))


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(density=0.1, epsilon=0.15), "epsilon"),
        (dict(density=0.9, epsilon=0.1), "epsilon"),
        (dict(epsilon=-0.1), "epsilon"),
        (dict(weights=[1.0, -1.0]), "weights >= 0"),
        (dict(gamma=0.1), "--gamma does not apply"),
    ],
)
def test_della_bad_parameters(kw, message):
    with pytest.raises(InputError, match=message):
        resolve_parameters(options(method="della", **kw), 2)


# -- Model Stock -----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("filter_wise", [False, True])
def test_model_stock(three_fine_tunes, tmp_path, n, filter_wise):
    doc, merged = run_merge(three_fine_tunes, tmp_path / "o", "model-stock", n, filter_wise=filter_wise)

    def ref(name, b, fs):
        b64, f64_ = f64s(b, fs)
        return M.ref_model_stock(b64, f64_, filter_wise)

    check_all(three_fine_tunes, merged, n, ref)
    if not filter_wise:
        assert all(r["stock_t"] is not None for r in doc["tensors"])


def test_model_stock_agreeing_finetunes_give_their_average(tmp_path):
    """Two fine-tunes with the same task vector: cos = 1, t = 1, W = their average."""
    base = torch.randn(64, 32, dtype=torch.float64)
    d = 0.01 * torch.randn(64, 32, dtype=torch.float64)
    out = ms_mod.model_stock(base, [base + d, base + d])
    assert torch.allclose(out, base + d, atol=1e-15)
    opposite = ms_mod.model_stock(base, [base + d, base - d])  # cos = −1: 1 + (N−1)·cos = 0 → BASE
    assert torch.equal(opposite, base)
    with pytest.raises(InputError, match="at least 2 fine-tunes"):
        resolve_parameters(MergeOptions(method="model-stock"), 1)


def test_model_stock_in_row_blocks(three_fine_tunes, tmp_path):
    _, whole = run_merge(three_fine_tunes, tmp_path / "w", "model-stock", 3)
    _, blocks = run_merge(three_fine_tunes, tmp_path / "b", "model-stock", 3, block_bytes=2048)
    for name in whole:
        assert rel(f64(blocks[name]), f64(whole[name])) <= 1e-7, name


# -- normalize ---------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["ties", "dare-ties"])
def test_normalize_false_is_the_disjoint_sum(three_fine_tunes, tmp_path, method):
    w = [1.0, 0.5, 2.0]
    kw = dict(weights=w, density=0.3, normalize=False)
    if method == "dare-ties":
        kw["seed"] = 5
    doc, merged = run_merge(three_fine_tunes, tmp_path / "o", method, 3, **kw)
    assert doc["parameters"]["normalize"] is False

    def ref(name, b, fs):
        b64, f64_ = f64s(b, fs)
        if method == "ties":
            parts = [np.where(M.topk_mask(f - b64, 0.3), f - b64, 0.0) for f in f64_]
        else:
            parts = []
            for i, f in enumerate(f64_):
                keep = M.dare_keep(5, name, i, 0.3, b.size, CHUNK).reshape(b.shape)
                parts.append(np.where(keep, (f - b64) / 0.3, 0.0))
        return b64 + M.elect(parts, w, normalize=False)

    check_all(three_fine_tunes, merged, 3, ref)
    with pytest.raises(InputError, match="--normalize does not apply"):
        resolve_parameters(options(method="task-arithmetic", normalize=True), 2)
