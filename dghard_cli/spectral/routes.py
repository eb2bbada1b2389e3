"""Linear-algebra routes to a delta's spectrum: the float64 Gram matrix accumulated over row
blocks and its eigendecomposition (``gram64``), or a float32 TSQR with a float64 eigensolve of
RᵀR and an error bound that says when its cut is safe (``qr32``); which route a device takes."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch

from dghard_cli.errors import InputError
from dghard_cli.spectral.marchenko_pastur import (
    omega,
)
from dghard_cli.spectral.spectrum import FAST_FP64_CAPABILITIES, ROUTES, ShrinkSpec, Spectrum


def gram_accumulate(blocks: Iterable[torch.Tensor], m_small: int, device: torch.device) -> torch.Tensor:
    """``G = Σ_b X_bᵀ X_b`` in float64 over row blocks ``X_b`` (``rows x M``) of the tall form."""
    g = torch.zeros((m_small, m_small), dtype=torch.float64, device=device)
    for xb in blocks:
        gram_add_(g, xb.to(device=device, dtype=torch.float64))
    return g


def gram_add_(g: torch.Tensor, x: torch.Tensor) -> None:
    """``g += xᵀx`` in float64, through torch's BLAS (one thread pool for all the heavy work:
    numpy's OpenBLAS pool running beside torch's OpenMP pool slowed eigensolvers 50x here)."""
    g.addmm_(x.T, x)


def gram_growth(rows: int) -> float:
    """How the rounding of a float64 Gram matrix ``XᵀX`` of an N-row X grows with N, in units of
    ``ε·λ_max``: √N. Measured on random and low-rank X, ``‖fl(XᵀX) − XᵀX‖₂`` came to about
    0.1·√N·ε·λ_max (1.6, 4.6, 16.5 and 32 at N = 300, 3 000, 30 000 and 150 000); the
    Gram routes' error bounds scale each eigenvalue's error ``ε·λ_max`` by it."""
    return math.sqrt(max(rows, 1))


#: Eigenvalues of the float64 Gram matrix below ``GRAM_FLOOR * M * eps * λ_max`` are rounding
#: error of its formation and eigendecomposition, not singular values: they are set to zero.
GRAM_FLOOR = 4.0


def spectrum_from_gram(
    g: torch.Tensor, shape: tuple[int, int], *, lazy_vectors: bool | None = None
) -> Spectrum:
    """Eigendecomposition of the Gram matrix: σ descending, vectors to match.

    ``lazy_vectors`` (default: on the CPU) computes the eigenvalues alone now and only the
    vectors a filter needs later (:meth:`Spectrum.vectors_for`): about half the cost of a
    full decomposition when few components are kept. Singular values below the route's
    resolution (``sqrt(4 M eps) σ_max``, about 1e-6 σ_max for M = 4096) are exact zeros: an
    exactly rank-deficient delta then has a well-defined numerical rank, the same whatever
    rotation of it is given.
    """
    g = 0.5 * (g + g.T)  # exact symmetry for the eigensolver
    if lazy_vectors is None:
        lazy_vectors = g.device.type == "cpu"
    if lazy_vectors:
        lam = torch.linalg.eigvalsh(g).flip(0).numpy().astype(np.float64)
        vectors = None
    else:
        evals, evecs = torch.linalg.eigh(g)
        lam = evals.flip(0).cpu().numpy().astype(np.float64)
        vectors = evecs.flip(1)
    floor = GRAM_FLOOR * g.shape[0] * np.finfo(np.float64).eps * max(float(lam[0]) if lam.size else 0.0, 0.0)
    lam[lam <= floor] = 0.0
    sig = np.sqrt(lam)
    fro2 = float(torch.trace(g))
    return Spectrum(shape=shape, sigma=sig, fro2=fro2, gram=g if lazy_vectors else None, full_vectors=vectors)


def choose_route(device: torch.device, requested: str = "auto") -> str:
    """``gram64`` (float64 Gram) everywhere float64 is fast; ``qr32`` on GPUs where it is not."""
    if requested not in ROUTES:
        raise InputError(f"--route {requested!r} is not one of {', '.join(ROUTES)}")
    if requested != "auto":
        return requested
    if (
        device.type == "cuda"
        and tuple(torch.cuda.get_device_capability(device)) not in FAST_FP64_CAPABILITIES
    ):
        return "qr32"
    return "gram64"


def spectrum_from_r(
    r: torch.Tensor, shape: tuple[int, int], fro2: float, eigh_device: torch.device, out_device: torch.device
) -> tuple[Spectrum, float]:
    """Spectrum from the float32 R factor: float64 eigendecomposition of RᵀR.

    Returns the spectrum and the absolute error bound of its singular values used to check
    threshold decisions (see :func:`qr_decision_is_safe`).
    """
    m_small = r.shape[1]
    r64 = r.to(device=eigh_device, dtype=torch.float64)
    if r64.shape[0] < m_small:  # fewer rows than columns only for a tall form with N < M (not reached)
        r64 = torch.cat([r64, r64.new_zeros((m_small - r64.shape[0], m_small))], dim=0)
    lazy = eigh_device.type == "cpu" and out_device.type == "cpu"
    spec = spectrum_from_gram(r64.T @ r64, shape, lazy_vectors=lazy)
    if spec.full_vectors is not None:
        spec.full_vectors = spec.full_vectors.to(out_device)
    spec.fro2 = fro2
    sigma_max = float(spec.sigma[0]) if spec.sigma.size else 0.0
    bound = QR32_ERROR_FACTOR * math.sqrt(m_small) * 2.0**-24 * sigma_max
    return spec, bound


#: Singular values of the float32 QR route are trusted to ``QR32_ERROR_FACTOR·sqrt(M)·u32·σ_max``
#: (Householder QR backward error, with a safety factor; measured errors sit well below it).
QR32_ERROR_FACTOR = 8.0


def qr_decision_is_safe(
    sigma: np.ndarray, tau: float, bound: float, spec: ShrinkSpec, shape: tuple[int, int]
) -> bool:
    """True when no singular value is within the float32 route's error of the threshold.

    The threshold itself moves with the median (unknown noise: by at most ω·bound), so a
    component is decided safely when ``|σ_i − τ| > bound·(1 + ω·scale)``. Soft and optimal
    shrinkers are continuous in σ; their decision is the hard one at the same τ.
    """
    if sigma.size == 0 or bound == 0.0:
        return True
    big, small = max(shape), min(shape)
    slack = bound * (1.0 + (omega(small / big) * spec.scale if spec.noise == "median" else 0.0))
    return bool(np.min(np.abs(sigma - tau)) > slack)


def tall_rows(x: torch.Tensor, rows_per_block: int) -> Iterable[torch.Tensor]:
    """Row blocks of a matrix already in its tall form."""
    for r0 in range(0, x.shape[0], rows_per_block):
        yield x[r0 : r0 + rows_per_block]


def block_rows(ncols: int, budget_bytes: int, itemsize: int = 8) -> int:
    """Rows per block so one float64 block of ``ncols`` columns fits in ``budget_bytes``."""
    return max(1, budget_bytes // max(1, ncols * itemsize))
