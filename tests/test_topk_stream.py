"""The streamed exact top-k (TIES' and Breadcrumbs' selection on large tensors) is the
whole-tensor selection, entry for entry: the float64 numpy order (exact magnitude first, then
row-major position), whatever the blocks, with ties gathered or resolved by radix passes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dghard_cli.methods import ties as ties_mod
from dghard_cli.methods.topk_stream import StreamingTopK


def numpy_topk(r_work: np.ndarray, exact: np.ndarray, k: int) -> np.ndarray:
    """The reference order: rounded magnitude, then exact magnitude (both larger first), then position."""
    order = np.lexsort((np.arange(r_work.size), -exact, -r_work))
    mask = np.zeros(r_work.size, dtype=bool)
    mask[order[:k]] = True
    return mask


def _case(kind: int, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == 0:  # float32 values whose differences round onto each other at the threshold
        b = torch.randn(n, generator=g)
        tiny = torch.randint(-3, 4, (n,), generator=g).double() * 2.0**-30
        f = (b.double() + tiny + (torch.rand(n, generator=g) < 0.5).double()).float()
    elif kind == 1:  # small integers: huge ties, zeros
        b = torch.zeros(n)
        f = torch.randint(-4, 5, (n,), generator=g).float()
    elif kind == 2:  # bf16 inputs (repeated magnitudes)
        b = torch.randn(n, generator=g).to(torch.bfloat16).float()
        f = (b + 0.01 * torch.randn(n, generator=g)).to(torch.bfloat16).float()
    else:  # float64 work dtype
        b = torch.randn(n, generator=g, dtype=torch.float64)
        f = b + torch.randint(-2, 3, (n,), generator=g).double() * 1e-3
    return b, f


def run_stream(mag, exact_all, k, cuts, cap):
    s = StreamingTopK(mag.numel(), k, mag.dtype, cap=cap)
    blocks = list(zip(cuts[:-1], cuts[1:], strict=True))
    passes = 0
    while s.pending:
        for a, c in blocks:
            s.observe(mag[a:c].clone(), lambda pos, a=a, e=exact_all: e[a:][pos], owned=True)
        s.end_pass()
        passes += 1
    out = torch.cat([s.mask(mag[a:c].contiguous(), lambda pos, a=a: exact_all[a:][pos]) for a, c in blocks])
    return s, out, passes


@pytest.mark.parametrize("kind", [0, 1, 2, 3])
@pytest.mark.parametrize("cap", [0, 3, 1 << 22])
def test_streamed_selection_is_the_exact_top_k(kind, cap):
    g = torch.Generator().manual_seed(100 * kind + cap % 97)
    for trial in range(40):
        n = int(torch.randint(1, 2500, (1,), generator=g))
        b, f = _case(kind, n, g)
        mag = (f - b).abs()
        exact_all = (f.double() - b.double()).abs()
        density = float(torch.rand(1, generator=g)) * 1.05
        k = ties_mod.keep_count(n, density)
        cuts = sorted({0, n, *torch.randint(0, n + 1, (4,), generator=g).tolist()})
        s, out, passes = run_stream(mag, exact_all, k, cuts, cap)
        ref = numpy_topk(mag.double().numpy(), exact_all.numpy(), k)
        assert np.array_equal(out.numpy(), ref), (kind, cap, trial)
        assert s.kept == k
        whole = ties_mod.select_topk(mag, k, exact_all.__getitem__)
        assert torch.equal(ties_mod.selection_mask(mag, whole), out)
        if k > 0:
            assert s.threshold == float(whole.threshold)
        bits_passes = 2 if mag.dtype == torch.float32 else 4
        assert passes <= bits_passes + (1 if cap >= n else 4)
        if cap >= 2 * n and s.threshold > 0:  # the threshold's bucket gathered whole: 2 passes
            assert passes <= 2, (kind, trial, passes)


@pytest.mark.parametrize("kind", [0, 1, 2, 3])
@pytest.mark.parametrize("cap", [0, 3, 1 << 22])
@pytest.mark.parametrize("scratch", [False, True])
def test_trimming_in_place_is_the_masked_fill(kind, cap, scratch):
    """``trim_`` (hard shrinkage, then the kept entries at T put back) zeroes exactly what
    ``masked_fill_(~mask)`` zeroes, keeps the signed zeros, and counts the same ``kept``."""
    from dghard_cli.engine.scratch import Scratch

    g = torch.Generator().manual_seed(7 + 100 * kind + cap % 97)
    for trial in range(30):
        n = int(torch.randint(1, 2500, (1,), generator=g))
        b, f = _case(kind, n, g)
        delta = f - b
        mag = delta.abs()
        exact_all = (f.double() - b.double()).abs()
        k = ties_mod.keep_count(n, float(torch.rand(1, generator=g)) * 1.05)
        cuts = sorted({0, n, *torch.randint(0, n + 1, (4,), generator=g).tolist()})
        s_mask, masked, _ = run_stream(mag, exact_all, k, cuts, cap)
        s = StreamingTopK(n, k, mag.dtype, cap=cap)
        while s.pending:
            for a, c in zip(cuts[:-1], cuts[1:], strict=True):
                s.observe(mag[a:c].clone(), lambda pos, a=a, e=exact_all: e[a:][pos], owned=True)
            s.end_pass()
        work = Scratch() if scratch else None
        got = torch.cat(
            [
                s.trim_(delta[a:c].clone(), lambda pos, a=a, e=exact_all: e[a:][pos], work)
                for a, c in zip(cuts[:-1], cuts[1:], strict=True)
            ]
        )
        want = delta.clone().masked_fill_(~masked, 0)
        ints = torch.int32 if delta.dtype == torch.float32 else torch.int64
        assert torch.equal(got.view(ints), want.view(ints)), (kind, cap, trial)
        assert s.kept == s_mask.kept == k
        assert s.threshold == s_mask.threshold


def test_ties_at_the_threshold_take_exact_order_then_row_major():
    """Three entries round to the same float32 magnitude; their exact magnitudes decide, then position."""
    b = torch.tensor([2.0**-30, 0.0, 0.5, 2.0**-30, 0.0, 0.25], dtype=torch.float32)
    f = torch.tensor([1.0, 1.0, 0.5, 1.0, 1.0, 0.25], dtype=torch.float32)
    mag = (f - b).abs()
    exact = (f.double() - b.double()).abs()
    assert mag[0] == mag[1] == mag[3] == mag[4] == 1.0
    for cap in (0, 10):
        for k, expected in [(1, [1]), (2, [1, 4]), (3, [0, 1, 4]), (4, [0, 1, 3, 4])]:
            _, out, _ = run_stream(mag, exact, k, [0, 2, 3, 6], cap)
            assert torch.nonzero(out).reshape(-1).tolist() == expected, (cap, k)


def test_degenerate_counts():
    mag = torch.rand(100)
    exact = mag.double()
    for k in (0, 100):
        s, out, passes = run_stream(mag, exact, k, [0, 50, 100], 10)
        assert passes == 0 and int(out.sum()) == k and s.kept == k
    s, _, _ = run_stream(mag, exact, 100, [0, 50, 100], 10)
    assert s.threshold == float(mag.min())
    assert StreamingTopK(100, 0, torch.float32).threshold == float("inf")
    with pytest.raises(ValueError):
        StreamingTopK(10, 3, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [1, 37, 400, 999])
def test_ties_at_zero_need_no_exact_magnitude(dtype, k):
    """A tensor mostly left unchanged (a frozen embedding, a module no adapter touches): every
    zero entry ties at the threshold. They are exactly 0, so the selection is the reference's
    (row-major order among them) without asking for a single exact magnitude; before, a float64
    pass gathered all of them (minutes on a 10^8-entry embedding)."""
    g = torch.Generator().manual_seed(k)
    n = 1000
    b = torch.randn(n, generator=g, dtype=dtype)
    f = b.clone()
    changed = torch.randperm(n, generator=g)[:30]
    f[changed] += torch.randn(30, generator=g, dtype=dtype)
    mag = (f - b).abs()
    exact_all = (f.double() - b.double()).abs()
    want = numpy_topk(mag.double().numpy(), exact_all.numpy(), k)

    def no_exact(pos):
        raise AssertionError("an exact magnitude was asked for a tie at zero")

    caps = [0] if k < 30 else [0, 1 << 22]  # (k = 1: T is the largest change, not a tie at zero)
    for cap, cuts in [(c, cuts) for c in caps for cuts in ([0, n], [0, 7, 300, 301, 999, n])]:
        s = StreamingTopK(n, k, dtype, cap=cap)
        blocks = list(zip(cuts[:-1], cuts[1:], strict=True))
        while s.pending:
            for a, c in blocks:
                s.observe(mag[a:c].clone(), no_exact, owned=True)
            s.end_pass()
        got = torch.cat([s.mask(mag[a:c].contiguous(), no_exact) for a, c in blocks])
        np.testing.assert_array_equal(got.numpy(), want)
        assert s.kept == k
    sel = ties_mod.select_topk(mag, k, no_exact)
    np.testing.assert_array_equal(ties_mod.selection_mask(mag, sel).numpy(), want)


@pytest.mark.parametrize("dtype,shift", [(torch.int16, 0), (torch.int32, 16), (torch.int64, 48)])
def test_in_bucket_matches_the_shifted_keys_up_to_the_top_bucket(dtype, shift):
    """The range compare that replaced ``keys >> shift == b`` picks the same positions, the top
    bucket included (its upper end, ``(b + 1) << shift``, does not fit the key dtype)."""
    top = torch.iinfo(dtype).max
    rng = np.random.default_rng(5)
    keys = torch.from_numpy(rng.integers(0, top, size=5000, dtype=np.int64, endpoint=True)).to(dtype)
    keys[:3] = torch.tensor([0, top, top - 1], dtype=dtype)
    for b in {0, 1, int(keys[7]) >> shift, top >> shift}:
        want = np.flatnonzero(keys.numpy().astype(np.int64) >> shift == b)
        np.testing.assert_array_equal(ties_mod.in_bucket(keys, shift, b).numpy(), want)
