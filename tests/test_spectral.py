"""The spectral core against a float64 numpy SVD reference."""

import numpy as np
import pytest
import torch
from reference import ref_filter, ref_omega, rel

from dghard_cli.errors import InputError
from dghard_cli.spectral.shrinkers import filter_dense, gd_threshold
from dghard_cli.spectral.spectrum import ShrinkSpec


def spiked(m, n, *, rank=4, strengths=(6.0, 3.0, 2.0, 1.2), noise=0.01, seed=0):
    """A few spikes over a Marchenko–Pastur bulk; strengths in units of the bulk edge."""
    rng = np.random.default_rng(seed)
    big, small = max(m, n), min(m, n)
    edge = noise * (np.sqrt(big) + np.sqrt(small))
    u = np.linalg.qr(rng.normal(size=(m, rank)))[0]
    v = np.linalg.qr(rng.normal(size=(n, rank)))[0]
    s = np.array(strengths[:rank]) * edge
    return noise * rng.normal(size=(m, n)) + (u * s) @ v.T


SHAPES = [(300, 200), (200, 300), (256, 256), (1000, 64), (64, 1000), (97, 61)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("shrink", ["hard", "soft", "optimal", "twoknob"])
@pytest.mark.parametrize("scale", [0.5, 1.0, 2.5])  # the strengths `dghard sweep` moves along
def test_filter_matches_float64_svd(shape, shrink, scale):
    d = spiked(*shape, seed=hash(shape) % 1000)
    kw = {"a": 0.9, "b": 0.3} if shrink == "twoknob" else {}
    ref, rank, tau = ref_filter(d, shrink=shrink, scale=scale, **kw)
    out, f = filter_dense(torch.from_numpy(d), ShrinkSpec(shrink=shrink, scale=scale, **kw))
    assert rel(out.numpy(), ref) < 1e-9
    assert abs(f.tau - tau) <= 1e-12 * tau
    if shrink in ("hard", "twoknob"):
        assert f.stats["spikes"] == int(np.count_nonzero(np.linalg.svd(d, compute_uv=False) > tau))
    if shrink == "hard":
        assert f.stats["rank_kept"] == rank


def test_known_noise_threshold():
    d = spiked(400, 300, noise=0.02)
    ref, rank, tau = ref_filter(d, sigma=0.02)
    out, f = filter_dense(torch.from_numpy(d), ShrinkSpec(noise="known", sigma=0.02))
    assert rel(out.numpy(), ref) < 1e-9 and f.stats["rank_kept"] == rank
    assert abs(f.tau - tau) < 1e-12 * tau


def test_median_is_the_statistical_median_for_even_counts():
    s = np.array([5.0, 4.0, 2.0, 1.0])  # numpy median 3.0; torch.median would give 2.0
    tau, med, _ = gd_threshold(s, (8, 4), ShrinkSpec())
    assert med == 3.0


def test_spikes_close_to_the_threshold_keep_the_reference_rank():
    # strengths chosen so the 3rd and 4th spikes land near τ
    for seed in range(6):
        d = spiked(512, 384, strengths=(8.0, 4.0, 1.25, 1.15), seed=seed)
        ref, rank, _ = ref_filter(d)
        out, f = filter_dense(torch.from_numpy(d), ShrinkSpec())
        assert f.stats["rank_kept"] == rank
        assert rel(out.numpy(), ref) < 1e-9


def test_scale_extremes():
    d = torch.from_numpy(spiked(120, 80))
    out, f = filter_dense(d, ShrinkSpec(scale=1e9))
    assert f.stats["rank_kept"] == 0 and float(out.abs().max()) == 0.0
    out, f = filter_dense(d, ShrinkSpec(scale=0.0))
    assert f.stats["rank_kept"] == 80 and rel(out.numpy(), d.numpy()) < 1e-12


def test_twoknob_contains_dg_hard_and_wise_ft():
    d = torch.from_numpy(spiked(150, 100))
    hard, _ = filter_dense(d, ShrinkSpec())
    tk, _ = filter_dense(d, ShrinkSpec(shrink="twoknob", a=1.0, b=0.0))
    assert rel(tk.numpy(), hard.numpy()) < 1e-12
    wise, _ = filter_dense(d, ShrinkSpec(shrink="twoknob", a=0.4, b=0.4))
    assert rel(wise.numpy(), 0.4 * d.numpy()) < 1e-12


def test_zero_delta_keeps_nothing_and_reports_zero_energy():
    out, f = filter_dense(torch.zeros(64, 32, dtype=torch.float64), ShrinkSpec())
    assert float(out.abs().max()) == 0.0 and f.stats["rank_kept"] == 0


def test_lora_merged_in_float32_is_detected_as_low_rank():
    rng = np.random.default_rng(3)
    w = rng.normal(size=(256, 128)).astype(np.float32) * 0.02
    ba = (rng.normal(size=(256, 8)) @ rng.normal(size=(8, 128)) * 1e-3).astype(np.float32)
    ft = (w + ba).astype(np.float32)
    d = torch.from_numpy(ft.astype(np.float64) - w.astype(np.float64))
    rms = float(np.sqrt(np.mean(ft.astype(np.float64) ** 2)))
    _, f = filter_dense(d, ShrinkSpec(), ft_dtype="F32", rms_ft=rms)
    assert f.stats["low_rank"] == 8
    # a genuine noisy update of the same size is not flagged
    noisy = torch.from_numpy(spiked(256, 128, noise=1e-3))
    _, g = filter_dense(noisy, ShrinkSpec(), ft_dtype="F32", rms_ft=0.02)
    assert g.stats["low_rank"] is None


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(shrink="nope"),
        dict(noise="known"),
        dict(noise="known", sigma=-1.0),
        dict(scale=float("nan")),
        dict(noise="x"),
    ],
)
def test_bad_specs_are_input_errors(kwargs):
    with pytest.raises(InputError):
        ShrinkSpec(**kwargs)


def _job_and_sources(delta: np.ndarray, base: np.ndarray | None = None):
    """A one-matrix job whose inputs live in memory (for the per-tensor routes)."""
    from dghard_cli.engine.ops import JobInputs
    from dghard_cli.engine.plan import TensorJob

    b = base if base is not None else np.zeros_like(delta)
    f = b + delta

    class Info:
        def __init__(self, t):
            self.t = torch.from_numpy(t.astype(np.float32))
            self.dtype, self.shape, self.name = "F32", tuple(t.shape), "w"

        def decode(self, raw, rows=None):
            return self.t if rows is None else self.t[rows[0] : rows[1]]

        def read(self, rows=None, pin=False):
            return self.decode(None, rows)

    job = TensorJob("w", "method", None, tuple(delta.shape), "F32", base=Info(b), fts=[Info(f)])
    return job, JobInputs(job, None)


@pytest.mark.parametrize("shape", [(600, 200), (200, 600), (300, 300)])
def test_float32_qr_route_matches_the_float64_reference(shape):
    from dghard_cli.methods.dg_hard import SpectralFilterOp

    for seed in range(4):
        d = spiked(*shape, strengths=(9.0, 4.0, 1.5, 1.3), seed=seed).astype(np.float32).astype(np.float64)
        ref, rank, tau = ref_filter(d)
        job, src = _job_and_sources(d)
        op = SpectralFilterOp(ShrinkSpec(), torch.device("cpu"), block_bytes=64 * 200 * 8, route="qr32")
        ds, dec = op.spectrum(job, src)
        filt = dec.filtered
        assert filt.stats["rank_kept"] == rank
        assert abs(filt.tau - tau) <= 1e-6 * tau
        from dghard_cli.spectral.spectrum import Projector

        proj = Projector.from_weights(ds.spectrum, filt.weights)
        x = torch.from_numpy(d if shape[0] >= shape[1] else d.T)
        out = proj.apply(x.clone()).numpy()
        out = out if shape[0] >= shape[1] else out.T
        assert rel(out, ref) < 1e-6, rel(out, ref)
        s = np.linalg.svd(d, compute_uv=False)
        assert np.max(np.abs(ds.spectrum.sigma - s)) <= ds.sigma_bound


def test_float32_qr_route_falls_back_to_float64_when_the_cut_is_ambiguous():
    from dghard_cli.methods.dg_hard import SpectralFilterOp
    from dghard_cli.spectral.marchenko_pastur import omega

    rng = np.random.default_rng(0)
    m, n = 400, 200
    u = np.linalg.qr(rng.normal(size=(m, n)))[0]
    v = np.linalg.qr(rng.normal(size=(n, n)))[0]
    s = np.sort(rng.uniform(0.5, 1.5, size=n))[::-1]
    s[0] = omega(n / m) * np.median(s) * (1 + 1e-9)  # a spike a hair above τ
    s = np.sort(s)[::-1]
    d = (u * s) @ v.T
    job, src = _job_and_sources(d)
    ds, filt = SpectralFilterOp(ShrinkSpec(), torch.device("cpu"), route="qr32").spectrum(job, src)
    assert "ambiguous" in ds.route
    job, src = _job_and_sources(spiked(m, n))
    ds, _ = SpectralFilterOp(ShrinkSpec(), torch.device("cpu"), route="qr32").spectrum(job, src)
    assert ds.route.startswith("qr-float32")


def _designed(m: int, lam: np.ndarray, seed: int = 0) -> torch.Tensor:
    q = np.linalg.qr(np.random.default_rng(seed).normal(size=(m, m)))[0]
    return torch.from_numpy((q * lam) @ q.T)


@pytest.mark.parametrize("where", ["top", "bottom"])
def test_partial_eigenvectors_match_a_full_decomposition(where):
    from dghard_cli.spectral.spectrum import partial_eigenvectors

    for m, k in [(300, 1), (300, 8), (500, 30), (64, 5)]:
        if where == "top":  # spikes over a Marchenko-Pastur bulk
            d = spiked(900, m, rank=min(k, 4), strengths=(8.0, 5.0, 4.0, 3.0), seed=m + k)
            g = torch.from_numpy(d.T @ d)
        else:  # a bulk over a few near-null directions (what a cut keeping most leaves out)
            lam = np.concatenate([np.linspace(2.0, 1.0, m - k), np.linspace(0.05, 0.01, k)])
            g = _designed(m, lam, seed=m)
        lam_all, vec = np.linalg.eigh(g.numpy())
        lam_all, vec = lam_all[::-1], vec[:, ::-1]
        if where == "bottom":
            kk = k
        else:  # the components the Gavish-Donoho cut keeps
            sv = np.sqrt(np.clip(lam_all, 0, None))
            kk = int(np.count_nonzero(sv > ref_omega(m / 900) * np.median(sv)))
        idx = np.arange(kk) if where == "top" else np.arange(m - kk, m)
        v = partial_eigenvectors(g, lam_all, idx)
        assert v is not None, (m, kk)
        p_ref = vec[:, idx] @ vec[:, idx].T
        assert np.linalg.norm(v.numpy() @ v.numpy().T - p_ref) < 1e-8
        assert np.allclose(v.numpy().T @ v.numpy(), np.eye(kk), atol=1e-10)
    assert partial_eigenvectors(g, lam_all, np.array([0, 2])) is None  # not a block: full decomposition


def test_partial_eigenvectors_refuse_what_they_cannot_certify():
    from dghard_cli.spectral.spectrum import partial_eigenvectors

    # the wanted eigenvalue sits on a cluster 1e-9 below it: no cheap filter separates them
    m = 120
    lam = np.concatenate([[1.0], 1.0 - 1e-9 * np.arange(1, 30), np.linspace(0.5, 0.1, m - 30)])
    g = _designed(m, lam)
    assert partial_eigenvectors(g, np.sort(lam)[::-1], np.arange(1)) is None
    # a filter that needs vectors then gets them from the full decomposition, still exact
    d = spiked(400, 100)
    out, _ = filter_dense(torch.from_numpy(d), ShrinkSpec())
    ref, _, _ = ref_filter(d)
    assert rel(out.numpy(), ref) < 1e-9
