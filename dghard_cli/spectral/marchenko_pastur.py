"""The Marchenko–Pastur law and the Gavish–Donoho constants, in float64.

For an ``M x N`` matrix (``M <= N``, ``beta = M / N``) of i.i.d. entries with variance
``s**2``, the squared singular values divided by ``N s**2`` follow, as the size grows, the
Marchenko–Pastur law with ratio ``beta``: support ``[(1 - sqrt(beta))**2, (1 + sqrt(beta))**2]``,
density ``sqrt((b - x)(x - a)) / (2 pi beta x)``, mean 1.

Everything here is exact to float64 rounding: the CDF is the closed-form antiderivative of the
density (no quadrature), the median is found by bisection on it (not the cubic approximation
of the Gavish–Donoho paper's code), and the constants are checked in the tests against values
computed independently with scipy.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np


def mp_support(beta: float) -> tuple[float, float]:
    """Support ``(a, b)`` of the Marchenko–Pastur law with ratio ``beta`` and unit variance."""
    _check_beta(beta)
    r = math.sqrt(beta)
    return (1.0 - r) ** 2, (1.0 + r) ** 2


def _check_beta(beta: float) -> None:
    if not (0.0 < beta <= 1.0):
        raise ValueError(f"beta must be in (0, 1], got {beta}")


def _antiderivative(x: np.ndarray, a: float, b: float) -> np.ndarray:
    """An antiderivative of sqrt((b - x)(x - a)) / x on [a, b].

    The textbook form uses arcsin, which loses half the digits near the support's edges
    (its derivative is unbounded at ±1); the same angles are computed here with atan2 and the
    exactly factored cosines: 1 - z1² = 4(x-a)(b-x)/(b-a)², 1 - z2² = 4ab(x-a)(b-x)/((b-a)x)².
    """
    r = np.sqrt(np.clip((b - x) * (x - a), 0.0, None))
    s = 0.5 * (a + b)
    out = r + s * np.arctan2(2.0 * x - a - b, 2.0 * r)
    if a > 0.0:
        g = math.sqrt(a * b)
        out = out - g * np.arctan2((a + b) * x - 2.0 * a * b, 2.0 * g * r)
    return out


def mp_cdf(x: np.ndarray | float, beta: float) -> np.ndarray:
    """CDF of the Marchenko–Pastur law (ratio ``beta`` in (0, 1], unit variance)."""
    a, b = mp_support(beta)
    xs = np.asarray(x, dtype=np.float64)
    inside = np.clip(xs, max(a, 1e-300), b)
    g_a = -0.5 * math.pi * (0.5 * (a + b) - math.sqrt(a * b))  # antiderivative at x = a
    val = (_antiderivative(inside, a, b) - g_a) / (2.0 * math.pi * beta)
    return np.clip(np.where(xs <= a, 0.0, np.where(xs >= b, 1.0, val)), 0.0, 1.0)


@lru_cache(maxsize=4096)
def mp_median(beta: float) -> float:
    """Median of the Marchenko–Pastur law with ratio ``beta`` (bisection to float64 precision)."""
    a, b = mp_support(beta)
    lo, hi = a, b
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if float(mp_cdf(mid, beta)) < 0.5:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def lambda_star(beta: float) -> float:
    """Gavish–Donoho optimal hard-threshold coefficient for known noise, λ*(β)."""
    _check_beta(beta)
    return math.sqrt(
        2.0 * (beta + 1.0) + 8.0 * beta / ((beta + 1.0) + math.sqrt(beta * beta + 14.0 * beta + 1.0))
    )


@lru_cache(maxsize=4096)
def omega(beta: float) -> float:
    """Gavish–Donoho coefficient for unknown noise: ω(β) = λ*(β) / sqrt(μ_β)."""
    return lambda_star(beta) / math.sqrt(mp_median(beta))


def optimal_frobenius_shrink(y: np.ndarray, beta: float) -> np.ndarray:
    """Gavish–Donoho (2017) Frobenius-optimal singular value shrinker.

    ``y`` are singular values in units of the noise (``σ_i / (sqrt(N) s)``); returns the
    shrunk values in the same units: ``sqrt((y² − β − 1)² − 4β) / y`` above the bulk edge
    ``1 + sqrt(β)``, zero below it.
    """
    y = np.asarray(y, dtype=np.float64)
    edge = 1.0 + math.sqrt(beta)
    out = np.zeros_like(y)
    above = y > edge
    ya = y[above]
    out[above] = np.sqrt(np.clip((ya * ya - beta - 1.0) ** 2 - 4.0 * beta, 0.0, None)) / ya
    return out


def ks_distance(x: np.ndarray, beta: float) -> float:
    """Kolmogorov–Smirnov distance between samples ``x`` (normalised σ²) and the MP law."""
    xs = np.sort(np.asarray(x, dtype=np.float64))
    n = xs.size
    if n == 0:
        return float("nan")
    f = mp_cdf(xs, beta)
    i = np.arange(1, n + 1, dtype=np.float64)
    return float(max(np.max(i / n - f), np.max(f - (i - 1) / n)))
