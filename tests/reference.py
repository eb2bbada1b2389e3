"""Independent float64 references, written for the tests (numpy + scipy only).

Nothing here imports dghard_cli: the Marchenko–Pastur median is found with scipy quadrature and
root finding (the package uses a closed-form CDF and bisection), singular values come from
numpy's SVD (the package uses a Gram eigendecomposition).
"""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path

import numpy as np
from scipy import integrate, optimize

DATA = Path(__file__).parent / "data"


def gd_reference_rows() -> list[dict]:
    return json.loads((DATA / "gavish_donoho.json").read_text())["rows"]


def ref_lambda_star(beta: float) -> float:
    return math.sqrt(2 * (beta + 1) + 8 * beta / ((beta + 1) + math.sqrt(beta**2 + 14 * beta + 1)))


@cache
def ref_mp_median(beta: float) -> float:
    a, b = (1 - math.sqrt(beta)) ** 2, (1 + math.sqrt(beta)) ** 2

    def density(x: float) -> float:
        return math.sqrt(max((b - x) * (x - a), 0.0)) / (2 * math.pi * beta * x)

    def cdf(x: float) -> float:
        return integrate.quad(density, a, x, limit=400, epsabs=1e-14, epsrel=1e-13)[0]

    return optimize.brentq(lambda x: cdf(x) - 0.5, a + 1e-12, b, xtol=1e-15, rtol=1e-15)


def ref_omega(beta: float) -> float:
    return ref_lambda_star(beta) / math.sqrt(ref_mp_median(beta))


def ref_weights(
    s: np.ndarray,
    shape: tuple[int, int],
    *,
    shrink: str = "hard",
    scale: float = 1.0,
    sigma: float | None = None,
    a: float = 1.0,
    b: float = 0.0,
) -> tuple[np.ndarray, float]:
    """Per-component weights and τ, straight from the definitions."""
    m, n = shape
    big, small = max(m, n), min(m, n)
    beta = small / big
    if sigma is None:
        tau = scale * ref_omega(beta) * float(np.median(s))
        noise = float(np.median(s)) / math.sqrt(big * ref_mp_median(beta))
    else:
        tau = scale * ref_lambda_star(beta) * math.sqrt(big) * sigma
        noise = sigma
    if shrink == "hard":
        w = (s > tau).astype(float)
    elif shrink == "soft":
        w = np.where(s > 0, np.maximum(s - tau, 0) / np.where(s > 0, s, 1), 0.0)
    elif shrink == "twoknob":
        w = np.where(s > tau, a, b)
    elif shrink == "optimal":
        unit = math.sqrt(big) * noise * scale
        y = s / unit
        eta = np.where(
            y > 1 + math.sqrt(beta),
            np.sqrt(np.maximum((y**2 - beta - 1) ** 2 - 4 * beta, 0)) / np.where(y > 0, y, 1),
            0.0,
        )
        w = np.where(s > 0, eta * unit / np.where(s > 0, s, 1), 0.0)
    else:
        raise ValueError(shrink)
    return w, tau


def ref_filter(delta: np.ndarray, **kw) -> tuple[np.ndarray, int, float]:
    """Filtered delta by a full float64 SVD; returns (Δ*, rank kept, τ)."""
    u, s, vt = np.linalg.svd(delta.astype(np.float64), full_matrices=False)
    w, tau = ref_weights(s, delta.shape, **kw)
    out = (u * (w * s)) @ vt
    return out, int(np.count_nonzero(w * s > 0)), tau


def rel(a: np.ndarray, b: np.ndarray) -> float:
    den = float(np.linalg.norm(b))
    return float(np.linalg.norm(a - b)) / (den if den > 0 else 1.0)
