"""Reused work buffers (engine.scratch) and the merge routes that run over them: every route
with a scratch gives the same bits as the allocating one, and nothing taken from a scratch
leaves its job."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from dghard_cli.engine import scratch as S
from dghard_cli.methods import ties as T
from dghard_cli.methods.task_arithmetic import task_arithmetic_delta, weighted_sum
from dghard_cli.methods.wise_ft import wise_ft_delta


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal including the sign of zero (and NaN where NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ints = {torch.float32: torch.int32, torch.float64: torch.int64}[a.dtype]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


# -- the scratch itself ------------------------------------------------------------------------


def test_take_reuses_grows_and_shares_a_slot_across_dtypes():
    s = S.Scratch()
    a = s.take("x", (4, 5), torch.float32)
    assert a.shape == (4, 5) and a.dtype == torch.float32 and a.is_contiguous()
    ptr = a.untyped_storage().data_ptr()
    b = s.take("x", (3,), torch.float64)  # 24 bytes <= 80: the same buffer
    assert b.untyped_storage().data_ptr() == ptr and b.dtype == torch.float64
    c = s.take("x", (7,), torch.bool)
    assert c.untyped_storage().data_ptr() == ptr
    assert s.nbytes() == 80
    d = s.take("x", (100,), torch.float32)  # larger: a new buffer, the old one dropped
    assert d.numel() == 100 and s.nbytes() == 400
    other = s.take("y", (2,), torch.int32)
    assert other.untyped_storage().data_ptr() != d.untyped_storage().data_ptr()
    assert s.owns(d) and s.owns(d[10:20]) and s.owns(other)
    assert not s.owns(torch.zeros(3))
    s.release()
    assert s.nbytes() == 0
    assert s.take("z", (0,), torch.float32).numel() == 0


def test_current_is_none_outside_a_job_and_set_inside():
    assert S.current() is None
    pool = S.ScratchPool()
    with pool.job() as s:
        assert S.current() is s
        s.take("a", (10,), torch.float32)
    assert S.current() is None
    with pool.job() as s2:  # the next job reuses the first one's buffers
        assert s2 is s and s2.nbytes() == 40
    seen: list = []
    t = threading.Thread(target=lambda: seen.append(S.current()))
    with pool.job():
        t.start()
        t.join()
    assert seen == [None]  # per thread
    pool.release()
    assert s.nbytes() == 0


def test_pool_gives_concurrent_jobs_distinct_scratches():
    pool = S.ScratchPool()
    with pool.job() as a, pool.job() as b:
        assert a is not b


def test_a_merge_leaves_no_scratch_behind(three_fine_tunes, tmp_path):
    from dghard_cli.engine.writer import RunOptions
    from dghard_cli.merging import MergeOptions, merge

    opts = MergeOptions(method="ties", run=RunOptions(device="cpu", quiet=True), density=0.3)
    merge(three_fine_tunes["base_dir"], three_fine_tunes["ft_dirs"][:2], tmp_path / "o", opts)
    assert S.current() is None


# -- TIES over a scratch: the same bits ------------------------------------------------------


def masked_trim(delta: torch.Tensor, sel: T.TopK) -> torch.Tensor:
    """The allocating trim (the route before the scratch one)."""
    return delta.clone().masked_fill_(~T.selection_mask(delta.abs(), sel), 0)


def tie_heavy(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Few distinct magnitudes, both signs, signed zeros: ties at every threshold."""
    g = torch.Generator().manual_seed(seed)
    levels = torch.tensor([0.0, -0.0, 0.25, 0.5, 1.0, 3.0], dtype=dtype)
    x = levels[torch.randint(0, len(levels), (n,), generator=g)]
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).to(dtype)
    return x * sign


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("density", [0.0, 0.05, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("kind", ["random", "ties", "near"])
def test_trim_in_place_equals_the_mask(dtype, density, kind):
    n = 3001
    g = torch.Generator().manual_seed(7)
    if kind == "random":
        d = torch.randn(n, generator=g, dtype=dtype)
    elif kind == "ties":
        d = tie_heavy(n, dtype, 1)
    else:  # neighbours of the threshold: one ulp above and below, both signs
        t = torch.tensor(0.3, dtype=dtype)
        up, down = torch.nextafter(t, t + 1), torch.nextafter(t, t - 1)
        d = torch.stack([t, -t, up, -up, down, -down]).repeat(n // 6 + 1)[:n]
        d = d[torch.randperm(n, generator=g)]
    k = T.keep_count(n, density)
    work = S.Scratch()
    sel = T.select_topk(d.abs(), k, work=work)
    ref = T.select_topk(d.abs(), k)
    assert torch.equal(sel.threshold, ref.threshold) and torch.equal(sel.keep_equal, ref.keep_equal)
    assert (sel.above, sel.equal, sel.k) == (ref.above, ref.equal, ref.k)
    want = masked_trim(d, sel)
    got = T.trim_(d.clone(), sel)
    assert same_bits(got, want)
    assert int(torch.count_nonzero(got != 0)) <= k


def test_trim_keeps_exactly_k_against_numpy():
    """The scratch route's selection and trim against a float64 numpy top-k (row-major ties)."""
    d = tie_heavy(2000, torch.float64, 5).reshape(40, 50)
    k = 333
    work = S.Scratch()
    sel = T.select_topk(d.abs(), k, work=work)
    got = T.trim_(d.clone(), sel).numpy()
    a = np.abs(d.numpy()).ravel()
    order = np.lexsort((np.arange(a.size), -a))  # larger first, then row-major
    keep = np.zeros(a.size, dtype=bool)
    keep[order[:k]] = True
    np.testing.assert_array_equal(got.ravel(), np.where(keep, d.numpy().ravel(), 0.0))


def test_radix_candidates_over_a_scratch_match():
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float64):
        m = torch.randn(50_000, generator=g, dtype=dtype).abs()
        m[::7] = m[3]  # many equal to one value
        for k in (1, 7, 1000, 49_999):
            a = T._kth_largest_candidates(m, k)
            b = T._kth_largest_candidates(m, k, S.Scratch())
            assert torch.equal(a[0], b[0]) and a[1] == b[1] and torch.equal(a[2], b[2])


def election_cases():
    g = torch.Generator().manual_seed(11)
    for dtype in (torch.float32, torch.float64):
        for n_ft in (1, 2, 3):
            ts = [tie_heavy(4000, dtype, s) for s in range(n_ft)]
            yield ts, [1.0, 0.5, 2.0][:n_ft]
            yield ts, [0.0, 1.0, 0.3][:n_ft]
            yield [torch.randn(4000, generator=g, dtype=dtype) for _ in range(n_ft)], [0.7, 1.3, 1.0][:n_ft]
        a = torch.randn(4000, generator=g, dtype=dtype)
        yield [a.clone(), -a], [1.0, 1.0]  # exact cancellation: a zero sum elects +
        yield [a.clone(), a.clone()], [0.0, 0.0]  # every weight zero
        yield [tie_heavy(4000, dtype, 9), tie_heavy(4000, dtype, 10)], [1e-40, 1.0]  # subnormal weight
        yield [tie_heavy(4000, dtype, 9), tie_heavy(4000, dtype, 10)], [1e-300, 1e-300]


@pytest.mark.parametrize("normalize", [True, False])
def test_election_over_a_scratch_gives_the_same_bits(normalize):
    for ts, w in election_cases():
        stats_a: dict = {}
        stats_b: dict = {}
        want = T.ties_delta([t.clone() for t in ts], w, 1.3, stats_a, normalize=normalize)
        mine = [t.clone() for t in ts]
        got = T.ties_delta(mine, w, 1.3, stats_b, normalize=normalize, work=S.Scratch())
        assert same_bits(got, want), (w, ts[0].dtype)
        assert stats_a == stats_b
        assert torch.isfinite(got).all()


def test_election_without_work_leaves_its_inputs_alone():
    ts = [tie_heavy(100, torch.float32, s) for s in range(2)]
    copies = [t.clone() for t in ts]
    T.ties_delta(ts, [1.0, 1.0], 1.0, {})
    assert all(same_bits(a, b) for a, b in zip(ts, copies, strict=True))


# -- the elementwise kernels that overwrite their own deltas -----------------------------------


@pytest.mark.parametrize("weights", [[1.0, -0.5, 0.25], [0.3, 1.0], [1.0]])
def test_overwriting_weighted_sums_are_the_allocating_ones(weights):
    g = torch.Generator().manual_seed(2)
    ds = [torch.randn(1000, generator=g) for _ in weights]
    orig = [d.clone() for d in ds]
    want = task_arithmetic_delta(ds, weights, 0.8)
    assert all(
        same_bits(d, o) for d, o in zip(ds, orig, strict=True)
    )  # the allocating route: inputs untouched
    mine = [d.clone() for d in ds]
    got = task_arithmetic_delta(mine, weights, 0.8, overwrite=True)
    assert same_bits(got, want) and got is mine[0]
    assert same_bits(
        weighted_sum([d.clone() for d in ds], weights, overwrite=True), weighted_sum(ds, weights)
    )
    assert same_bits(wise_ft_delta(ds[0].clone(), 0.3, overwrite=True), wise_ft_delta(ds[0], 0.3))


# -- whole commands: the pipeline's scratch route against the allocating one ---------------------


def _run_both(monkeypatch, tmp_path, run) -> tuple[dict, dict]:
    """``run(out)`` with the pipeline's scratches, then with every op allocating."""
    from conftest import load_dir

    run(tmp_path / "scratch")
    import dghard_cli.methods.dg_hard as dg
    import dghard_cli.methods.merge_ops as mo
    import dghard_cli.methods.subspace as sub

    with monkeypatch.context() as m:
        m.setattr(dg, "current", lambda: None)
        m.setattr(mo, "current", lambda: None)
        m.setattr(sub, "current", lambda: None)
        run(tmp_path / "alloc")
    return load_dir(tmp_path / "scratch"), load_dir(tmp_path / "alloc")


@pytest.mark.parametrize("out_dtype", ["F64", None])
@pytest.mark.parametrize("block_bytes", [None, 20_000])
def test_repair_over_scratch_writes_what_the_allocating_route_writes(
    monkeypatch, tmp_path, out_dtype, block_bytes
):
    """float64 outputs are the float64 sums themselves (no cast): nothing taken from a scratch
    may reach the writer, in one block or many, on the workers or the main thread."""
    from dghard_cli.engine.plan import PolicyOptions
    from dghard_cli.engine.writer import RunOptions
    from dghard_cli.repairing import RepairOptions, repair
    from dghard_cli.testing.synthetic import ArchConfig, make_pair

    cfg = ArchConfig(hidden_size=48, intermediate_size=136, num_hidden_layers=2, vocab_size=200)
    base, ft = make_pair(tmp_path / "m", cfg, ft_shards=2, seed=4)
    run, policy = RunOptions(device="cpu", quiet=True), PolicyOptions(out_dtype=out_dtype)
    opts = RepairOptions(run=run, policy=policy, block_bytes=block_bytes)
    a, b = _run_both(monkeypatch, tmp_path, lambda out: repair(base, ft, out, opts))
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and same_bits(a[name].double(), b[name].double()), name


@pytest.mark.parametrize("method", ["task-arithmetic", "ties", "dg-hard", "slerp", "tsv", "iso-c"])
def test_merges_over_scratch_write_what_the_allocating_route_writes(
    monkeypatch, tmp_path, three_fine_tunes, method
):
    from dghard_cli.engine.plan import PolicyOptions
    from dghard_cli.engine.writer import RunOptions
    from dghard_cli.merging import MergeOptions, merge

    n = 2
    kw = {"ties": {"density": 0.3}, "slerp": {"extra": {"t": 0.4}}}.get(method, {})
    run, policy = RunOptions(device="cpu", quiet=True), PolicyOptions(out_dtype="F64")
    opts = MergeOptions(method=method, run=run, policy=policy, block_bytes=4096, **kw)
    fts = three_fine_tunes["ft_dirs"][: 1 if method == "slerp" else n]
    a, b = _run_both(monkeypatch, tmp_path, lambda out: merge(three_fine_tunes["base_dir"], fts, out, opts))
    for name in a:
        assert a[name].dtype == torch.float64 and same_bits(a[name], b[name]), name


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4001, 40_003])
def test_flat_nonzero_is_torch_nonzero(n):
    g = torch.Generator().manual_seed(n)
    for p in (0.0, 1e-4, 0.01, 0.3, 1.0):
        mask = torch.rand(n, generator=g) < p
        assert torch.equal(T.flat_nonzero(mask), torch.nonzero(mask).reshape(-1))
        if n > 9:  # a view that starts off an 8-byte boundary, and a 2-D mask
            assert torch.equal(T.flat_nonzero(mask[3:]), torch.nonzero(mask[3:]).reshape(-1))
        if n % 8 == 0 and n:
            m2 = mask.reshape(8, -1)
            assert torch.equal(T.flat_nonzero(m2), torch.nonzero(m2.reshape(-1)).reshape(-1))


def test_merged_block_leaves_float64_inputs_alone():
    """Without a scratch, the spectral merge's block copies float64 inputs before writing
    into them (``.to(float64)`` of a float64 tensor is the tensor itself)."""
    from dghard_cli.methods.dg_hard import _filtered_block, _merged_block
    from dghard_cli.spectral.spectrum import Projector

    g = torch.Generator().manual_seed(1)
    b = torch.randn(6, 9, generator=g, dtype=torch.float64)
    fs = [b + 0.1 * torch.randn(6, 9, generator=g, dtype=torch.float64) for _ in range(2)]
    before = [t.clone() for t in (b, *fs)]
    vs = torch.linalg.qr(torch.randn(6, 2, generator=g, dtype=torch.float64))[0]
    proj = Projector(vs=vs, d=torch.tensor([0.5, -0.25], dtype=torch.float64), c=0.9)
    out = _merged_block(b, fs, [proj, proj], [0.3, 1.3], 0.8, False, torch.float64, lambda t: t)
    out1 = _filtered_block(b, fs[0], proj, False, torch.float64, lambda t: t)
    assert all(same_bits(t, o) for t, o in zip((b, *fs), before, strict=True))
    assert out.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert out1.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
