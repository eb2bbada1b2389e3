"""Every merge method against an independent float64 numpy reference, on generated 2- and
3-model checkpoints (real Llama tensor names, sharded), plus the properties the definitions
promise: exact top-k with deterministic ties, DARE's seeded stream, survivors exactly Δ/(1−p)."""

from __future__ import annotations

import math

import merge_reference as M
import numpy as np
import pytest
import torch
from conftest import f64, load_dir
from reference import ref_filter, rel

from dghard_cli.engine.ops import JobInputs
from dghard_cli.engine.plan import PolicyOptions, build_plan
from dghard_cli.engine.writer import RunOptions
from dghard_cli.io.hub import open_checkpoint
from dghard_cli.merging import MergeOptions, _make_op, merge, merge_eligibility, resolve_parameters
from dghard_cli.methods import dare as dare_mod
from dghard_cli.methods import ties as ties_mod
from dghard_cli.testing.synthetic import ArchConfig, make_pair

TOL = 1e-6
CFG = ArchConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2, vocab_size=256)


def run_merge(three_fine_tunes, out, method, n, **kw):
    run = RunOptions(device="cpu", quiet=True)
    opts = MergeOptions(method=method, run=run, **kw)
    doc = merge(three_fine_tunes["base_dir"], three_fine_tunes["ft_dirs"][:n], out, opts)
    return doc, load_dir(out)


def check_all(three_fine_tunes, merged, n, ref_fn):
    """Every tensor of the output against ``ref_fn(name, base64, [ft64...])``."""
    base, fts = three_fine_tunes["base"], three_fine_tunes["fts"][:n]
    assert set(merged) == set(base)
    worst = 0.0
    for name, b in base.items():
        ref = ref_fn(name, f64(b), [f64(f[name]) for f in fts])
        out = merged[name]
        assert out.dtype == torch.float32
        e = rel(f64(out), ref)
        worst = max(worst, e)
        assert e <= TOL, f"{name}: relative error {e:.2e}"
    return worst


def test_same_base_different_deltas(three_fine_tunes):
    b = three_fine_tunes["base"]
    f1, f2 = three_fine_tunes["fts"][:2]
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(f1[name], f2[name])
    # the generator is deterministic: b/base equals a/base
    assert torch.equal(load_dir(three_fine_tunes["root"] / "b" / "base")[name], b[name])


def test_wise_ft(three_fine_tunes, tmp_path):
    doc, merged = run_merge(three_fine_tunes, tmp_path / "o", "wise-ft", 1, alpha=0.3)
    check_all(three_fine_tunes, merged, 1, lambda n, b, fs: M.ref_wise_ft(b, fs[0], 0.3))
    assert doc["parameters"]["alpha"] == 0.3
    assert doc["summary"]["actions"] == {"method": len(three_fine_tunes["base"])}


@pytest.mark.parametrize("n", [2, 3])
def test_task_arithmetic_with_negation(three_fine_tunes, tmp_path, n):
    w = [1.0, -0.5, 0.25][:n]
    doc, merged = run_merge(three_fine_tunes, tmp_path / "o", "task-arithmetic", n, weights=w, lam=0.8)
    check_all(three_fine_tunes, merged, n, lambda name, b, fs: M.ref_task_arithmetic(b, fs, w, 0.8))
    assert doc["parameters"]["weights"] == w and doc["parameters"]["lambda"] == 0.8


@pytest.mark.parametrize("n", [2, 3])
def test_ties(three_fine_tunes, tmp_path, n):
    w = [1.0, 0.5, 2.0][:n]
    doc, merged = run_merge(three_fine_tunes, tmp_path / "o", "ties", n, weights=w, density=0.3, lam=1.2)
    check_all(three_fine_tunes, merged, n, lambda name, b, fs: M.ref_ties(b, fs, w, 0.3, 1.2))
    # the report: exact kept counts and sign conflicts, per tensor
    for r in doc["tensors"]:
        numel = math.prod(r["shape"])
        assert r["kept"] == [M.keep_count(numel, 0.3)] * n
        deltas = [
            f64(f[r["name"]]) - f64(three_fine_tunes["base"][r["name"]]) for f in three_fine_tunes["fts"][:n]
        ]
        trimmed = [np.where(M.topk_mask(d, 0.3), d, 0.0) for d in deltas]
        pos = np.any([t > 0 for t in trimmed], axis=0)
        neg = np.any([t < 0 for t in trimmed], axis=0)
        assert r["sign_conflicts"] == int(np.count_nonzero(pos & neg))
    assert doc["merge"]["sign_conflicts"] > 0


def test_ties_in_row_blocks(three_fine_tunes, tmp_path):
    """Tensors too large for one block: whole-tensor selection, then trimming block by block."""
    w = [1.0, 0.5, 2.0]
    _, merged = run_merge(
        three_fine_tunes, tmp_path / "o", "ties", 3, weights=w, density=0.3, block_bytes=4096, whole_bytes=0
    )
    check_all(three_fine_tunes, merged, 3, lambda name, b, fs: M.ref_ties(b, fs, w, 0.3, 1.0))


def test_ties_bf16_inputs_many_ties(tmp_path):
    """bf16 deltas repeat magnitudes a lot: the deterministic tie-break decides the output."""
    base, ft1 = make_pair(tmp_path / "a", CFG, dtype="bfloat16", ft_shards=2, seed=3)
    _, ft2 = make_pair(tmp_path / "b", CFG, dtype="bfloat16", ft_shards=1, seed=3, delta_seed=4)
    b, fs = load_dir(base), [load_dir(ft1), load_dir(ft2)]
    name = "model.layers.1.mlp.down_proj.weight"
    d = f64(fs[0][name]) - f64(b[name])
    a = np.sort(np.abs(d).ravel())[::-1]
    k = M.keep_count(a.size, 0.25)
    assert a[k - 1] == a[k], "the test needs a tie at the threshold"
    opts = MergeOptions(
        method="ties",
        density=0.25,
        run=RunOptions(device="cpu", quiet=True),
        policy=PolicyOptions(out_dtype="F32"),
    )
    merge(base, [ft1, ft2], tmp_path / "o", opts)
    merged = load_dir(tmp_path / "o")
    for n, t in b.items():
        ref = M.ref_ties(f64(t), [f64(f[n]) for f in fs], [1.0, 1.0], 0.25, 1.0)
        assert rel(f64(merged[n]), ref) <= TOL, n


@pytest.mark.parametrize("method", ["dare-linear", "dare-ties"])
@pytest.mark.parametrize("n", [2, 3])
def test_dare_against_reference(three_fine_tunes, tmp_path, method, n):
    w = [1.0, 0.7, 0.4][:n]
    doc, merged = run_merge(
        three_fine_tunes, tmp_path / "o", method, n, weights=w, density=0.4, lam=0.9, seed=7
    )
    ties = method == "dare-ties"
    check_all(
        three_fine_tunes,
        merged,
        n,
        lambda name, b, fs: M.ref_dare(b, fs, w, 0.4, 0.9, 7, name, dare_mod.CHUNK, ties=ties),
    )
    # kept fraction within 3 standard deviations of the density, per tensor and in total
    kept = total = 0
    for r in doc["tensors"]:
        numel = math.prod(r["shape"])
        for k in r["kept"]:
            assert abs(k / numel - 0.4) <= 3 * math.sqrt(0.4 * 0.6 / numel) + 1 / numel, r["name"]
            kept += k
            total += numel
    assert abs(kept / total - 0.4) <= 3 * math.sqrt(0.4 * 0.6 / total)


def test_dare_survivors_exactly_rescaled(three_fine_tunes, tmp_path):
    """One fine-tune, weight 1, λ 1, float32 work: kept entries are exactly b + fl32(Δ/(1−p)), the rest b."""
    _, merged = run_merge(three_fine_tunes, tmp_path / "o", "dare-linear", 1, density=0.3, seed=5)
    b, f = three_fine_tunes["base"], three_fine_tunes["fts"][0]
    kept_total = 0
    for name in b:
        b32 = b[name].numpy()
        d32 = f[name].numpy() - b32  # float32, as the merge forms it
        keep = M.dare_keep(5, name, 0, 0.3, d32.size, dare_mod.CHUNK).reshape(d32.shape)
        out = merged[name].numpy()
        survivor = (d32.astype(np.float64) / 0.3).astype(np.float32)  # correctly rounded Δ/(1−p)
        expected = np.where(keep, b32 + survivor, b32)
        assert np.array_equal(out, expected), name
        kept_total += int(keep.sum())
    assert kept_total > 0
    # the pure function: survivors are Δ / density in float64, bit for bit
    d = torch.randn(1000, dtype=torch.float64)
    for density in (0.3, 0.4, 0.7):
        out = dare_mod.dare(d, density, 5, "x")
        keep = out != 0
        assert np.array_equal(out[keep].numpy(), d[keep].numpy() / density)  # numpy: correctly rounded
        assert abs(int(keep.sum()) - 1000 * density) < 3 * math.sqrt(1000 * density * (1 - density))


def test_dare_identical_across_runs_layouts_blocks_and_order(three_fine_tunes, tmp_path):
    kw = dict(density=0.35, seed=11)
    _, first = run_merge(three_fine_tunes, tmp_path / "o1", "dare-ties", 3, **kw)
    _, again = run_merge(three_fine_tunes, tmp_path / "o2", "dare-ties", 3, **kw)
    # different output shard layout and tiny row blocks (many blocks per tensor)
    opts = MergeOptions(
        method="dare-ties",
        run=RunOptions(device="cpu", quiet=True),
        policy=PolicyOptions(shard_size=20_000),
        block_bytes=2048,
        **kw,
    )
    merge(three_fine_tunes["base_dir"], three_fine_tunes["ft_dirs"], tmp_path / "o3", opts)
    other = load_dir(tmp_path / "o3")
    assert len(list((tmp_path / "o3").glob("*.safetensors"))) > 3
    for name in first:
        assert torch.equal(first[name], again[name]), name
        assert torch.equal(first[name], other[name]), name
    # another seed gives another result
    _, seeded = run_merge(three_fine_tunes, tmp_path / "o4", "dare-ties", 3, density=0.35, seed=12)
    assert not torch.equal(
        first["model.layers.0.mlp.up_proj.weight"], seeded["model.layers.0.mlp.up_proj.weight"]
    )

    # tensors processed in reverse order, straight through the pipeline operation
    base = open_checkpoint(str(three_fine_tunes["base_dir"]))
    fts = [open_checkpoint(str(p)) for p in three_fine_tunes["ft_dirs"]]
    plan = build_plan(base, fts, PolicyOptions(), eligible=merge_eligibility(PolicyOptions()))
    mo = MergeOptions(method="dare-ties", **kw)
    op = _make_op("dare-ties", resolve_parameters(mo, 3), mo, None, torch.device("cpu"))
    for job in reversed(plan.jobs):
        blocks = list(op(job, JobInputs(job, None), {}))
        t = torch.cat([x.reshape(-1) for x in blocks]).reshape(job.shape)
        assert torch.equal(t, first[job.name]), job.name


def test_dare_stream_independent_of_chunk_boundaries(monkeypatch):
    """A tensor spanning several chunks: blocks cut anywhere give the whole-tensor mask."""
    monkeypatch.setattr(dare_mod, "CHUNK", 1000)
    n = 4321
    whole = dare_mod.keep_mask(3, "w", 1, 0.5, n, 0, n)
    assert np.array_equal(whole.numpy(), M.dare_keep(3, "w", 1, 0.5, n, 1000))
    cuts = [0, 7, 999, 1000, 1001, 2500, 4000, n]
    parts = [dare_mod.keep_mask(3, "w", 1, 0.5, n, a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    assert torch.equal(torch.cat(parts), whole)
    stream = dare_mod.DareStream(3, "w", 1, 0.5, n)
    d = torch.ones(n, dtype=torch.float64)
    out = torch.cat([stream(d[a:b]) for a, b in zip(cuts[:-1], cuts[1:], strict=True)])
    assert torch.equal(out != 0, whole) and stream.kept == int(whole.sum())
    # different name, index or seed: a different stream
    assert not torch.equal(whole, dare_mod.keep_mask(3, "w", 0, 0.5, n, 0, n))
    assert not torch.equal(whole, dare_mod.keep_mask(3, "v", 1, 0.5, n, 0, n))
    assert not torch.equal(whole, dare_mod.keep_mask(4, "w", 1, 0.5, n, 0, n))


def test_dg_hard_merge(three_fine_tunes, tmp_path):
    w = [1.0, 0.5, 0.75]
    doc, merged = run_merge(three_fine_tunes, tmp_path / "o", "dg-hard", 3, weights=w, lam=0.9)

    def ref(name, b, fs):
        if b.ndim == 2 and b.size >= 1024:
            return b + 0.9 * sum(wi * ref_filter(f - b)[0] for wi, f in zip(w, fs, strict=True))
        return M.ref_task_arithmetic(b, fs, w, 0.9)

    check_all(three_fine_tunes, merged, 3, ref)
    by_name = {r["name"]: r for r in doc["tensors"]}
    up = by_name["model.layers.0.mlp.up_proj.weight"]
    assert up["merge_rule"] == "dg-hard"
    b = f64(three_fine_tunes["base"]["model.layers.0.mlp.up_proj.weight"])
    for i, f in enumerate(three_fine_tunes["fts"]):
        assert up["ranks"][i] == ref_filter(f64(f["model.layers.0.mlp.up_proj.weight"]) - b)[1]
    assert up["ranks"] == [4, 4, 4]  # the planted rank
    assert by_name["model.norm.weight"]["merge_rule"] == "task-arithmetic"
    assert doc["merge"]["filtered_matrices"] == sum(1 for r in doc["tensors"] if len(r["shape"]) == 2)


# -- the selection itself ------------------------------------------------------------------


def test_topk_exact_count_and_row_major_ties():
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        n = int(torch.randint(1, 400, (1,), generator=g))
        x = torch.randint(-4, 5, (n,), generator=g).to(torch.float64)  # many ties, zeros
        density = float(torch.rand(1, generator=g)) * 0.999 + 0.001
        k = ties_mod.keep_count(n, density)
        mask = ties_mod.topk_mask(x.abs(), k)
        assert int(mask.sum()) == k
        assert np.array_equal(mask.numpy(), M.topk_mask(x.numpy(), density)), trial
        # row blocks of any size give the same mask
        sel = ties_mod.select_topk(x.abs(), k)
        tm = ties_mod.TopKMask(sel)
        cuts = sorted({0, n, *torch.randint(0, n + 1, (3,), generator=g).tolist()})
        blocks = torch.cat([tm(x[a:b].abs()) for a, b in zip(cuts[:-1], cuts[1:], strict=True)])
        assert torch.equal(blocks, mask) and tm.kept == k


def test_keep_count_matches_definition():
    assert ties_mod.keep_count(1000, 0.2) == 200
    assert ties_mod.keep_count(10, 0.01) == 1  # at least one
    assert ties_mod.keep_count(10, 1.0) == 10
    assert ties_mod.keep_count(100, 0.29) == int(0.29 * 100)


def test_pure_ties_functions():
    base = torch.zeros(6, dtype=torch.float64)
    a = torch.tensor([3.0, -1.0, 2.0, 0.0, -5.0, 1.0], dtype=torch.float64)
    b = torch.tensor([-4.0, 2.0, 1.0, 0.0, -1.0, 0.5], dtype=torch.float64)
    out = ties_mod.ties_merge(base, [a, b], [1.0, 1.0], density=1.0, lam=1.0)
    # sums: -1, 1, 3, 0, -6, 1.5 -> signs -, +, +, +, -, +
    expected = torch.tensor([-4.0, 2.0, 1.5, 0.0, -3.0, 0.75], dtype=torch.float64)
    assert torch.equal(out, expected)
    assert ties_mod.sign_conflicts([a, b]) == 2


def test_selection_is_exact_when_float32_rounding_makes_ties():
    """Δ formed in float32 can round two different magnitudes to one value at the threshold:
    the kept entry is still the exactly larger one (then the first in row-major order)."""
    from dghard_cli.methods.merge_ops import TiesKernel

    b = torch.tensor([2.0**-30, 0.0, 0.5, 2.0**-30, 0.25], dtype=torch.float32)
    f = torch.tensor([1.0, 1.0, 0.5, 1.0, 0.25], dtype=torch.float32)
    d32 = (f - b).abs()
    assert d32[0] == d32[1] == d32[3]  # 1 − 2^-30 rounds to 1 in float32

    def exact(i, pos):
        return (f[pos].double() - b[pos].double()).abs()

    for k, expected in [(1, [1]), (2, [0, 1]), (3, [0, 1, 3])]:
        for whole in (True, False):  # one pass on the whole tensor, or statistics passes
            kern = TiesKernel([1.0], 1.0, k / 5, 5)
            kern.begin(torch.float32, whole=whole)
            while kern.pending():
                kern.observe(b, [f])
                kern.end_pass()
            d = f - b
            if whole:
                kern.trim_whole(0, d, lambda pos: exact(0, pos))
            out = kern.combine(b, [d], exact)
            kept = torch.nonzero(out).reshape(-1).tolist()
            assert kept == expected, (k, whole, kept)
    # without the exact magnitudes the float32 ties would fall to row-major order
    assert ties_mod.topk_mask(d32, 1).nonzero().reshape(-1).tolist() == [0]
