"""Exact low-rank factors of a weight update (pure float64 math).

A LoRA adapter stores an update as ``Δ = L·R`` (``L`` is ``m x k``, ``R`` is ``k x n``). Two ways
to get such factors exactly:

- :func:`factorize` from a dense ``Δ``: the float64 Gram matrix of its tall form (``XᵀX`` on
  the smaller side, accumulated over row blocks), its eigendecomposition, and the projection of
  ``Δ`` onto the top-``k`` right singular subspace: ``Δ ≈ (X V_k) V_kᵀ``. ``k`` is the numerical
  rank (singular values above ``NUMERICAL_RANK_RTOL·σ_1``), capped by ``max_rank``; the
  truncation is the Eckart–Young optimum, and the energy it loses is reported.
- :func:`factorize_product` from factors ``Δ = B·A`` (``B`` is ``m x r``, ``A`` is ``r x n``,
  e.g. PEFT's concatenation of several adapters) without forming ``Δ``: thin QR of ``B`` and
  ``Aᵀ``, the SVD of the ``r x r`` core ``R_B R_Aᵀ``, in ``O((m + n) r²)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from dghard_cli.spectral.routes import spectrum_from_gram

#: Singular values below this fraction of the largest are rounding noise (the Gram route resolves
#: about √ε₆₄ ≈ 1.5e-8 of σ₁, a float32-stored delta about 6e-8 of each entry).
NUMERICAL_RANK_RTOL = 1e-6


@dataclass
class Factors:
    """``Δ ≈ left @ right`` with ``left`` ``m x k`` and ``right`` ``k x n`` (float64)."""

    left: torch.Tensor
    right: torch.Tensor
    sigma: np.ndarray  # singular values of Δ, descending (the numerically resolved ones)
    numerical_rank: int
    fro2: float  # ‖Δ‖_F²
    kept2: float  # ‖left @ right‖_F²

    @property
    def rank(self) -> int:
        return int(self.left.shape[1])

    @property
    def energy_kept(self) -> float:
        return self.kept2 / self.fro2 if self.fro2 > 0 else 1.0

    @property
    def energy_lost(self) -> float:
        return max(0.0, 1.0 - self.energy_kept)

    def stats(self) -> dict:
        return {
            "rank": self.rank,
            "numerical_rank": self.numerical_rank,
            "energy_kept": float(f"{self.energy_kept:.10g}"),
            "energy_lost": float(f"{self.energy_lost:.3g}"),
            "sigma_max": float(self.sigma[0]) if self.sigma.size else 0.0,
        }


def _rank(sigma: np.ndarray, max_rank: int | None) -> tuple[int, int]:
    if sigma.size == 0 or sigma[0] <= 0:
        return 0, 0
    numerical = int(np.count_nonzero(sigma > NUMERICAL_RANK_RTOL * sigma[0]))
    return numerical, numerical if max_rank is None else min(max_rank, numerical)


def _empty(m: int, n: int, fro2: float, device) -> Factors:
    return Factors(
        left=torch.zeros((m, 0), dtype=torch.float64, device=device),
        right=torch.zeros((0, n), dtype=torch.float64, device=device),
        sigma=np.zeros(0),
        numerical_rank=0,
        fro2=fro2,
        kept2=0.0,
    )


def factorize(
    delta: torch.Tensor,
    max_rank: int | None = None,
    *,
    block_bytes: int = 32 * 1024 * 1024,
    device: torch.device | None = None,
) -> Factors:
    """The top-``k`` singular components of a dense ``delta`` (any float dtype), exactly."""
    if delta.ndim != 2:
        raise ValueError("factorize needs a matrix")
    if max_rank is not None and max_rank < 1:
        raise ValueError("max_rank must be >= 1")
    device = device or delta.device
    m, n = (int(s) for s in delta.shape)
    tall = m >= n
    x = delta if tall else delta.T
    rows, cols = x.shape
    step = max(1, block_bytes // max(1, 8 * cols))

    def blocks() -> Iterable[torch.Tensor]:
        return (x[r0 : r0 + step] for r0 in range(0, rows, step))

    g = torch.zeros((cols, cols), dtype=torch.float64, device=device)
    for xb in blocks():
        gram_add(g, xb)
    fac = factors_from_gram(g, (rows, cols), blocks, max_rank)
    if tall:
        return fac
    return dataclasses.replace(fac, left=fac.right.T.contiguous(), right=fac.left.T.contiguous())


def gram_add(g: torch.Tensor, xb: torch.Tensor) -> None:
    """``g += xbᵀ xb`` in float64 on ``g``'s device (``xb``: a row block of the tall form)."""
    x = xb.to(device=g.device, dtype=torch.float64)
    g.addmm_(x.T, x)


def factors_from_gram(
    g: torch.Tensor,
    shape: tuple[int, int],
    blocks: Callable[[], Iterable[torch.Tensor]],
    max_rank: int | None = None,
) -> Factors:
    """Top-``k`` factors of a tall matrix ``X`` (``N x M``, ``N >= M``) from its float64 Gram
    ``g = XᵀX`` and a second pass over its row blocks (``blocks()`` yields them in order):
    ``X ≈ (X V_k) V_kᵀ``. The matrix itself never has to be in memory."""
    rows, cols = shape
    device = g.device
    fro2 = float(torch.trace(g))
    if not fro2 > 0:
        return _empty(rows, cols, max(fro2, 0.0), device)
    # eigenvalues first, then only the k vectors needed (certified subspace iteration on the CPU,
    # else the full decomposition): the spectral core's own route
    spectrum = spectrum_from_gram(g, (rows, cols))
    sigma = spectrum.sigma
    numerical, k = _rank(sigma, max_rank)
    if k == 0:
        return _empty(rows, cols, fro2, device)
    v = spectrum.vectors_for(np.arange(k)).to(device).contiguous()
    y = torch.cat([xb.to(device=device, dtype=torch.float64) @ v for xb in blocks()], dim=0)
    kept2 = float(torch.sum(y * y))
    return Factors(y, v.T.contiguous(), sigma[:numerical], numerical, fro2, kept2)


def factorize_product(b: torch.Tensor, a: torch.Tensor, max_rank: int | None = None) -> Factors:
    """Exact SVD factors of ``B·A`` (``m x r`` times ``r x n``) without forming the product."""
    if b.ndim != 2 or a.ndim != 2 or b.shape[1] != a.shape[0]:
        raise ValueError("factorize_product needs B (m x r) and A (r x n)")
    b64, a64 = b.to(torch.float64), a.to(torch.float64)
    m, n = b64.shape[0], a64.shape[1]
    qb, rb = torch.linalg.qr(b64)
    qa, ra = torch.linalg.qr(a64.T)
    core = rb @ ra.T
    u, s, vh = torch.linalg.svd(core)
    fro2 = float(torch.sum(s * s))
    sigma = s.cpu().numpy()
    numerical, k = _rank(sigma, max_rank)
    if k == 0:
        return _empty(m, n, fro2, b64.device)
    left = (qb @ u[:, :k]) * s[:k]
    right = (qa @ vh[:k].T).T.contiguous()
    kept2 = float(torch.sum(s[:k] ** 2))
    return Factors(left, right, sigma[:numerical], numerical, fro2, kept2)


def factorize_certified(
    blocks: Callable[[], Iterable[torch.Tensor]],
    shape: tuple[int, int],
    width: int,
    *,
    device: torch.device | None = None,
    seed: int = 0,
) -> Factors | None:
    """Exact factors of a tall matrix ``X`` (``N x M``) that is numerically of rank < ``width``,
    in two thin passes over its row blocks, ``O(N·M·width)``; None when ``X`` is not.

    Pass 1: ``Y = X Ω`` for a Gaussian ``Ω`` (``M x width``) and ``‖X‖²``; ``Q = orth(Y)``.
    Pass 2: ``C = QᵀX``. The residual ``‖X − Q Qᵀ X‖² = ‖X‖² − ‖C‖²`` is then known exactly: the
    result is returned only when it is below ``NUMERICAL_RANK_RTOL²·‖X‖²`` — what the numerical
    rank rule would discard anyway — so ``X = Q C`` to that tolerance and the SVD of the small
    ``C`` is the SVD of ``X`` (a certificate, not a probability). Otherwise the caller falls back
    to :func:`factors_from_gram`.
    """
    rows, cols = shape
    w = min(cols, max(1, width))
    dev = device or torch.device("cpu")
    omega = torch.randn((cols, w), generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dev)
    fro2 = 0.0
    ys = []
    for xb in blocks():
        x = xb.to(device=dev, dtype=torch.float64)
        fro2 += float(torch.sum(x * x))
        ys.append(x @ omega)
    if not fro2 > 0:
        return _empty(rows, cols, 0.0, dev)
    q = torch.linalg.qr(torch.cat(ys, dim=0))[0]
    del ys
    c = torch.zeros((q.shape[1], cols), dtype=torch.float64, device=dev)
    r0 = 0
    for xb in blocks():
        x = xb.to(device=dev, dtype=torch.float64)
        c.addmm_(q[r0 : r0 + x.shape[0]].T, x)
        r0 += x.shape[0]
    captured = float(torch.sum(c * c))
    if fro2 - captured > NUMERICAL_RANK_RTOL**2 * fro2:
        return None
    u, s, vt = torch.linalg.svd(c, full_matrices=False)
    sigma = s.cpu().numpy()
    numerical, k = _rank(sigma, None)
    if k == 0:
        return _empty(rows, cols, fro2, dev)
    left = q @ (u[:, :k] * s[:k])
    kept2 = float(torch.sum(s[:k] ** 2))
    return Factors(left, vt[:k].contiguous(), sigma[:numerical], numerical, fro2, kept2)
