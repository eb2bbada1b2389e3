"""Property tests of the spectral core (hypothesis)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dghard_cli.spectral.shrinkers import filter_dense
from dghard_cli.spectral.spectrum import ShrinkSpec

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def deltas(draw, noisy: bool = False) -> np.ndarray:
    m = draw(st.integers(2, 48))
    n = draw(st.integers(2, 48))
    seed = draw(st.integers(0, 2**31 - 1))
    rank = draw(st.integers(0, min(m, n)))
    strength = draw(st.floats(0.0, 20.0))
    # "noisy": noise well above float64 rounding of the signal (strength <= 20), which 1e-6 is not
    # always: a rank-1 delta of strength 20 with noise 1e-6 sits at the Gram route's rounding floor
    # (relative 3e-8), where repair rightly reports it as low-rank and keeps it at any scale
    noise = draw(st.sampled_from([1e-3, 1.0] if noisy else [0.0, 1e-6, 1e-3, 1.0]))
    rng = np.random.default_rng(seed)
    d = noise * rng.normal(size=(m, n))
    if rank:
        d += strength * rng.normal(size=(m, rank)) @ rng.normal(size=(rank, n)) / np.sqrt(m * n)
    return d


SPECS = st.sampled_from(
    [
        ShrinkSpec(),
        ShrinkSpec(shrink="soft"),
        ShrinkSpec(shrink="optimal"),
        ShrinkSpec(scale=0.5),
        ShrinkSpec(shrink="twoknob", a=0.8, b=0.2),
        ShrinkSpec(noise="known", sigma=1e-3),
    ]
)


@SETTINGS
@given(deltas(), SPECS)
def test_rank_kept_at_most_min_dim_and_norm_never_grows(d, spec):
    out, f = filter_dense(torch.from_numpy(d), spec)
    assert 0 <= f.stats["rank_kept"] <= min(d.shape)
    assert np.linalg.norm(out.numpy()) <= np.linalg.norm(d) * (1 + 1e-9) + 1e-300
    assert 0.0 <= f.stats["energy_kept"] <= 1.0 + 1e-12


@SETTINGS
@given(deltas(noisy=True))
def test_scale_extremes_give_base_and_fine_tune(d):
    # (an exactly low-rank delta has median 0, hence τ = 0 at any scale: the degenerate case
    # that repair detects and reports as low-rank)
    big, _ = filter_dense(torch.from_numpy(d), ShrinkSpec(scale=1e12))
    assert float(np.abs(big.numpy()).max(initial=0.0)) == 0.0
    zero, f = filter_dense(torch.from_numpy(d), ShrinkSpec(scale=0.0))
    scale = max(np.linalg.norm(d), 1e-300)
    assert np.linalg.norm(zero.numpy() - d) <= 1e-9 * scale


@SETTINGS
@given(st.integers(2, 40), st.integers(2, 40))
def test_zero_delta_is_left_alone(m, n):
    out, f = filter_dense(torch.zeros(m, n, dtype=torch.float64), ShrinkSpec())
    assert float(out.abs().max()) == 0.0 and f.stats["rank_kept"] == 0


@SETTINGS
@given(deltas(), st.integers(0, 2**31 - 1))
def test_kept_rank_is_invariant_under_orthogonal_rotations(d, seed):
    rng = np.random.default_rng(seed)
    m, n = d.shape
    q1 = np.linalg.qr(rng.normal(size=(m, m)))[0]
    q2 = np.linalg.qr(rng.normal(size=(n, n)))[0]
    _, f = filter_dense(torch.from_numpy(d), ShrinkSpec())
    _, g = filter_dense(torch.from_numpy(q1 @ d @ q2), ShrinkSpec())
    s = np.linalg.svd(d, compute_uv=False)
    tau = f.tau
    # a singular value within rounding of τ may legitimately fall either way
    if s.size and np.min(np.abs(s - tau)) > 1e-9 * max(s[0], 1e-300):
        assert f.stats["rank_kept"] == g.stats["rank_kept"]
