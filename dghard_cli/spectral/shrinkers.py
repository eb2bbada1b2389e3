"""The shrinkers: the noise level (from the median singular value, or known), the Gavish–Donoho
threshold τ, each shrinker's weights on the singular values (hard, soft, optimal, two-knob), the
low-rank (merged LoRA) test, and :func:`filter_spectrum`, which applies them to a spectrum."""

from __future__ import annotations

import math

import numpy as np
import torch

from dghard_cli.io.safetensors_format import UNIT_ROUNDOFF
from dghard_cli.spectral.marchenko_pastur import (
    ks_distance,
    lambda_star,
    mp_median,
    omega,
    optimal_frobenius_shrink,
)
from dghard_cli.spectral.routes import block_rows, gram_accumulate, spectrum_from_gram, tall_rows
from dghard_cli.spectral.spectrum import ROUNDING_STD_FACTOR, Filtered, Projector, ShrinkSpec, Spectrum


def noise_from_median(median_sv: float, shape: tuple[int, int]) -> float:
    """Per-entry noise std implied by the median singular value (Marchenko–Pastur)."""
    big, small = max(shape), min(shape)
    return median_sv / math.sqrt(big * mp_median(small / big))


def gd_threshold(sigma: np.ndarray, shape: tuple[int, int], spec: ShrinkSpec) -> tuple[float, float, float]:
    """Gavish–Donoho threshold ``τ`` (scale applied), the median σ, and the noise level used.

    Unknown noise: ``τ = scale·ω(β)·median(σ)``; known noise ``s``: ``τ = scale·λ*(β)·sqrt(N)·s``.
    The median is the statistical one (mean of the middle pair for an even count).
    """
    big, small = max(shape), min(shape)
    beta = small / big
    median_sv = float(np.median(sigma)) if sigma.size else 0.0
    if spec.noise == "known":
        assert spec.sigma is not None
        noise = float(spec.sigma)
        tau0 = lambda_star(beta) * math.sqrt(big) * noise
    else:
        noise = noise_from_median(median_sv, shape)
        tau0 = omega(beta) * median_sv
    return spec.scale * tau0, median_sv, noise


def shrink_weights(
    sigma: np.ndarray, shape: tuple[int, int], tau: float, noise: float, spec: ShrinkSpec
) -> np.ndarray:
    """Weight ``w_i`` per component so that the filtered singular values are ``w_i σ_i``.

    hard: 1 above τ, else 0 (strictly above, as the paper); soft: ``max(σ − τ, 0)/σ``;
    optimal: Gavish–Donoho 2017 Frobenius shrinker with noise ``scale·s``;
    twoknob: ``a`` above τ, ``b`` at or below.
    """
    sigma = np.asarray(sigma, dtype=np.float64)
    spikes = sigma > tau
    if spec.shrink == "hard":
        return spikes.astype(np.float64)
    if spec.shrink == "twoknob":
        return np.where(spikes, spec.a, spec.b).astype(np.float64)
    safe = np.where(sigma > 0, sigma, 1.0)
    if spec.shrink == "soft":
        return np.where(sigma > 0, np.maximum(sigma - tau, 0.0) / safe, 0.0)
    # optimal
    unit = math.sqrt(max(shape)) * noise * spec.scale
    if unit <= 0:
        return (sigma > 0).astype(np.float64)
    beta = min(shape) / max(shape)
    eta = optimal_frobenius_shrink(sigma / unit, beta) * unit
    return np.where(sigma > 0, eta / safe, 0.0)


def rounding_noise(rms_ft: float, ft_dtype: str) -> float:
    """Per-entry std of the storage rounding of a tensor with this rms in this dtype."""
    return ROUNDING_STD_FACTOR * UNIT_ROUNDOFF.get(ft_dtype, 2.0**-24) * rms_ft


def filter_spectrum(
    spectrum: Spectrum,
    spec: ShrinkSpec,
    *,
    ft_dtype: str = "F32",
    rms_ft: float | None = None,
) -> Filtered:
    """Threshold, weights and the per-matrix diagnostics the report carries."""
    sigma = spectrum.sigma
    shape = spectrum.shape
    big, small = spectrum.big, spectrum.small
    beta = spectrum.beta
    tau, median_sv, noise = gd_threshold(sigma, shape, spec)
    weights = shrink_weights(sigma, shape, tau, noise, spec)
    total = float(np.sum(sigma**2))
    kept_sv = weights * sigma
    energy_kept = float(np.sum(kept_sv**2) / total) if total > 0 else 1.0
    rank_kept = int(np.count_nonzero(kept_sv > 0))
    spikes = int(np.count_nonzero(sigma > tau))

    implied = noise_from_median(median_sv, shape)
    edge = implied * (math.sqrt(big) + math.sqrt(small))
    share_above_edge = float(np.count_nonzero(sigma > edge) / small) if small else 0.0
    bulk = sigma[sigma <= tau]
    ks = ks_distance(bulk**2 / (big * implied**2), beta) if implied > 0 and bulk.size >= 2 else None
    stats: dict = {
        "beta": beta,
        "median_sv": median_sv,
        "tau": tau,
        "noise_level": noise,
        "sigma_max": float(sigma[0]) if sigma.size else 0.0,
        "rank_kept": rank_kept,
        "spikes": spikes,
        "numerical_rank": int(np.count_nonzero(sigma > 0)),
        "energy_kept": energy_kept,
        "mp_edge": edge,
        "share_above_mp_edge": share_above_edge,
        "ks_distance": ks,
        "powerlaw_slope": powerlaw_slope(sigma),
    }
    if rms_ft is not None:
        rho = rounding_noise(rms_ft, ft_dtype)
        stats["rounding_ratio"] = implied / rho if rho > 0 else None
        stats["low_rank"] = is_low_rank(sigma, shape, implied, rho)
    return Filtered(weights=weights, tau=tau, stats=stats)


def is_low_rank(sigma: np.ndarray, shape: tuple[int, int], implied_noise: float, rho: float) -> int | None:
    """Rank ``r`` if Δ is an exact low-rank update over storage rounding (a merged LoRA), else None.

    The bulk (the noise implied by the median) is at the storage-rounding level of the
    fine-tune's dtype, and a few components stand far (10x) above that rounding bulk's edge:
    the median is rounding noise and the unknown-noise threshold means nothing there.
    """
    if rho <= 0 or implied_noise > 2.0 * rho:
        return None
    big, small = max(shape), min(shape)
    rounding_edge = rho * (math.sqrt(big) + math.sqrt(small))
    r = int(np.count_nonzero(sigma > 10.0 * rounding_edge))
    return r if 1 <= r <= small // 2 else None


def powerlaw_slope(sigma: np.ndarray) -> float | None:
    """Slope of log σ_i against log i over the top half of the spectrum (a bulk-free delta
    falls off like a power law; a spiked Marchenko–Pastur spectrum is flat after the spikes)."""
    half = sigma[: max(2, sigma.size // 2)]
    half = half[half > 0]
    if half.size < 3:
        return None
    x = np.log(np.arange(1, half.size + 1, dtype=np.float64))
    y = np.log(half)
    return float(np.polyfit(x, y, 1)[0])


def filter_dense(
    delta: torch.Tensor,
    spec: ShrinkSpec,
    *,
    ft_dtype: str = "F32",
    rms_ft: float | None = None,
    block_bytes: int = 64 * 1024 * 1024,
) -> tuple[torch.Tensor, Filtered]:
    """Filter an in-memory delta (any device); returns ``Δ*`` in float64 and the statistics.

    Public in-memory API (the commands stream row blocks through ``SpectralFilterOp``).
    """
    if delta.ndim != 2:
        raise ValueError("filter_dense needs a 2-D tensor")
    shape = (int(delta.shape[0]), int(delta.shape[1]))
    x = delta.T if shape[0] < shape[1] else delta
    rows = block_rows(x.shape[1], block_bytes)
    g = gram_accumulate(tall_rows(x, rows), x.shape[1], delta.device)
    spectrum = spectrum_from_gram(g, shape)
    filt = filter_spectrum(spectrum, spec, ft_dtype=ft_dtype, rms_ft=rms_ft)
    proj = Projector.from_weights(spectrum, filt.weights)
    out = torch.cat([proj.apply(b.to(torch.float64)) for b in tall_rows(x, rows)], dim=0)
    return (out.T if shape[0] < shape[1] else out), filt
