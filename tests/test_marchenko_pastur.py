"""Gavish–Donoho constants and the Marchenko–Pastur law against independent float64 values."""

import math

import numpy as np
import pytest
from reference import gd_reference_rows, ref_mp_median, ref_omega
from scipy import integrate

from dghard_cli.spectral.marchenko_pastur import (
    ks_distance,
    lambda_star,
    mp_cdf,
    mp_median,
    mp_support,
    omega,
    optimal_frobenius_shrink,
)


@pytest.mark.parametrize("row", gd_reference_rows(), ids=lambda r: f"beta={r['beta']}")
def test_constants_match_shared_reference(row):
    b = row["beta"]
    assert abs(lambda_star(b) - row["lambda_star"]) < 1e-9
    assert abs(mp_median(b) - row["mp_median"]) < 1e-9
    assert abs(omega(b) - row["omega"]) < 1e-9


def test_omega_at_square_matrices_is_the_papers_value():
    assert round(omega(1.0), 6) == 2.858362


@pytest.mark.parametrize("beta", [0.0123, 0.0732, 0.4321, 0.877, 0.995])
def test_median_matches_quadrature_at_other_ratios(beta):
    assert abs(mp_median(beta) - ref_mp_median(beta)) < 1e-10
    assert abs(omega(beta) - ref_omega(beta)) < 1e-10


@pytest.mark.parametrize("beta", [0.001, 0.05, 0.5, 1.0])
def test_cdf_matches_quadrature_everywhere_including_the_edges(beta):
    a, b = mp_support(beta)

    def density(x):
        return math.sqrt(max((b - x) * (x - a), 0.0)) / (2 * math.pi * beta * x)

    for x in np.linspace(a, b, 25):
        ref = integrate.quad(density, a, x, limit=400, epsabs=1e-14)[0] if x > a else 0.0
        assert abs(float(mp_cdf(x, beta)) - ref) < 1e-10
    assert float(mp_cdf(a - 1, beta)) == 0.0 and float(mp_cdf(b + 1, beta)) == 1.0


def test_cubic_approximation_is_not_used():
    # The paper's code approximates ω(β) by 0.56β³ − 0.95β² + 1.82β + 1.43; we compute it exactly.
    for beta in (0.1, 0.5, 0.9):
        approx = 0.56 * beta**3 - 0.95 * beta**2 + 1.82 * beta + 1.43
        assert abs(omega(beta) - approx) > 1e-4


def test_optimal_shrinker_zero_inside_bulk_and_identity_far_out():
    beta = 0.5
    edge = 1 + math.sqrt(beta)
    y = np.array([0.5, edge * 0.999, 100.0])
    out = optimal_frobenius_shrink(y, beta)
    assert out[0] == 0 and out[1] == 0
    assert abs(out[2] - 100.0) / 100.0 < 2e-4


def test_ks_distance_of_large_mp_sample_is_small():
    rng = np.random.default_rng(1)
    n, m = 2000, 1000
    x = rng.normal(size=(n, m))
    s = np.linalg.svd(x, compute_uv=False)
    assert ks_distance(s**2 / n, m / n) < 0.03
    assert ks_distance((s * 1.5) ** 2 / n, m / n) > 0.2
