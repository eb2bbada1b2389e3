"""The accurate route of the subspace merges: the same formulas from float64 SVDs of the matrices.

The streaming Gram route (:mod:`.subspace`) squares a matrix's condition number: a direction of
singular value σ comes out accurate to about ``ε·(σ_max/σ)²``. Where that bound exceeds the
output dtype's resolution (a float32 output of a merge whose flat spectrum or orthogonalisation
divides by singular values 10⁴ below the largest, say), the matrix is computed again here from
the SVDs of its task vectors themselves, accurate to about ``ε·σ_max/σ`` — never refused for
accuracy, never written approximately. The report's record of such a matrix says
``route: "svd-float64"`` and gives this route's ``error_bound``.

Each function below is the method's formula written out (see :mod:`.tsv` and :mod:`.iso` for the
formulas and the degenerate cases), on the tall forms ``X_i`` (N × M, N ≥ M) of the task vectors,
returning the merged update ``Δ*`` (N × M) whole. The numerical rank of every factorisation is
decided as on the Gram route (a squared singular value at or below ``GRAM_FLOOR·M·ε·σ_max²`` is
a zero, and so is one at a computed adapter's rounding level), so both routes merge the same
directions and differ only in rounding. With that floor, this route's bound ``ε·σ_max/σ_min``
stays below ``sqrt(ε/(4·M))`` ≤ 5.3e-9, finer than float32's unit roundoff.

Working set: the T tall task vectors, their sum or projections, the SVD factors and workspace and
``Δ*``, at most ``(2T + 6)·8·N·M`` bytes: 3 fine-tunes of a 4864 × 896 matrix, about 420 MB; of a
14336 × 4096 one, about 5.6 GB. :func:`svd_route_bytes` gives it, and the op checks it against the
process's memory before taking this route.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dghard_cli.engine.working_memory import dense_svd_bytes
from dghard_cli.spectral.routes import GRAM_FLOOR

EPS64 = 2.0**-52
ROUTE = "svd-float64"


@dataclass(frozen=True)
class SvdResult:
    """A method's merged update of one matrix by the accurate route."""

    delta: torch.Tensor  # N × M float64, the tall form of Δ*
    rank: int
    kappa: float  # the largest σ_max/σ_min divided by on the way (1 when none)
    stats: dict


def svd_route_bytes(rows: int, cols: int, n_fts: int) -> int:
    """Bytes of the accurate route's working set for one ``rows × cols`` matrix and T fine-tunes."""
    return dense_svd_bytes(rows, cols, n_fts)


def svd64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The thin SVD ``U, σ, Vᵀ`` of a float64 matrix. LAPACK's divide-and-conquer driver can fail
    to converge on many repeated singular values (an Iso-C merge's flat spectrum did, on a
    576 × 1536 matrix); then the transpose is tried, then the eigendecomposition of the smaller
    Gram matrix (exact for the repeated values that failed, ε·(σ_max/σ)² for small ones)."""
    try:
        return torch.linalg.svd(x, full_matrices=False)
    except torch.linalg.LinAlgError:
        pass
    try:
        u, s, vh = torch.linalg.svd(x.T, full_matrices=False)
        return vh.T, s, u.T
    except torch.linalg.LinAlgError:
        pass
    tall = x.shape[0] >= x.shape[1]
    y = x if tall else x.T
    lam, v = torch.linalg.eigh(y.T @ y)
    lam, v = lam.flip(0).clamp_(min=0.0), v.flip(1)
    s = lam.sqrt()
    keep = s > 0
    u = torch.zeros((y.shape[0], s.numel()), dtype=y.dtype, device=y.device)
    u[:, keep] = (y @ v[:, keep]) / s[keep]
    return (u, s, v.T) if tall else (v, s, u.T)


def top(
    x: torch.Tensor, k: int, reference: float | None = None, noise: float = 0.0
) -> tuple[torch.Tensor, np.ndarray, torch.Tensor, float]:
    """The top ``min(k, numerical rank)`` singular triplets of ``x`` (U: N × k', σ, V: M × k') and
    ``σ_ref/σ_k'``. ``reference``: the σ_max² of the matrix ``x`` was projected from (its rounding
    scales with it; default ``x``'s own); ``noise``: singular values at or below it are zeros."""
    u, s, vh = svd64(x)
    sig = s.cpu().numpy()
    lam_ref = float(sig[0] ** 2) if reference is None and sig.size else float(reference or 0.0)
    floor = GRAM_FLOOR * x.shape[1] * EPS64 * lam_ref
    rank = int(np.count_nonzero((sig > 0) & (sig**2 > floor) & (sig > noise)))
    k = max(0, min(k, rank))
    kappa = math.sqrt(lam_ref) / float(sig[k - 1]) if k else 1.0
    return u[:, :k].clone(), sig[:k].copy(), vh[:k].T.clone(), kappa  # the full factors can go


def polar(a: torch.Tensor) -> tuple[torch.Tensor, int, float]:
    """``P·Qᵀ`` of ``a = P·S·Qᵀ`` over its numerical rank (the partial isometry; the same floor as
    the Gram route's ``(AᵀA)^{+1/2}``), its rank and ``S_max/S_min`` over the kept values."""
    r = a.shape[1]
    if r == 0:
        return a, 0, 1.0
    p, s, qh = svd64(a)
    s_max = float(s[0])
    if not s_max > 0.0:
        return torch.zeros_like(a), 0, 1.0
    keep = s**2 > GRAM_FLOOR * r * EPS64 * s_max**2
    k = int(keep.sum())
    return p[:, :k] @ qh[:k], k, s_max / float(s[k - 1])


def _sum(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    s = xs[0].clone()
    for x in xs[1:]:
        s.add_(x)
    return s


def iso_c(xs: Sequence[torch.Tensor], alpha: float, noise: float) -> SvdResult:
    """Iso-C: ``α·σ̄·U_r·V_rᵀ`` of the SVD of ``Σ_i X_i`` over its numerical rank r."""
    u, sig, v, kappa = top(_sum(xs), xs[0].shape[1], noise=noise)
    mean = float(sig.mean()) if sig.size else 0.0
    delta = (u * (alpha * mean)) @ v.T
    return SvdResult(delta, int(sig.size), kappa, {"sigma_mean": float(f"{mean:.10g}")})


def tsv(xs: Sequence[torch.Tensor], k: int, alpha: float, noises: Sequence[float]) -> SvdResult:
    """TSV-M: ``α·polar(U_cat)·diag(σ_cat)·polar(V_cat)ᵀ`` of each task's top-k triplets."""
    parts = [top(x, k, noise=nz) for x, nz in zip(xs, noises, strict=True)]
    u_cat = torch.cat([p[0] for p in parts], dim=1)
    v_cat = torch.cat([p[2] for p in parts], dim=1)
    d = torch.as_tensor(np.concatenate([p[1] for p in parts]), dtype=torch.float64, device=u_cat.device)
    pu, ru, ku = polar(u_cat)
    pv, rv, kv = polar(v_cat)
    delta = (pu * (alpha * d)) @ pv.T if ru and rv else torch.zeros_like(xs[0])
    rank = min(ru, rv, int(torch.count_nonzero(d)))
    stats = {"per_task_rank": k, "task_ranks": [len(p[1]) for p in parts]}
    return SvdResult(delta, rank, max(1.0, *(p[3] for p in parts), ku, kv), stats)


def iso_cts(
    xs: Sequence[torch.Tensor],
    k_c: int,
    d: int,
    alpha: float,
    noise: float,
    noises: Sequence[float],
    tall: bool,
) -> SvdResult:
    """Iso-CTS: the common top-k_c triplets of ``Σ_i X_i``, each task's top-d triplets outside the
    common left space (``(I − U_c·U_cᵀ)·Δ_i`` in the matrix's own orientation: the left side of
    the tall form for a tall matrix, its right side for a wide one), a flat spectrum, polar
    factors. ``tall``: whether the matrix is stored tall (m ≥ n)."""
    u_c, sig_c, v_c, kappa = top(_sum(xs), k_c, noise=noise)
    kappas = [kappa]
    us: list[torch.Tensor] = []
    ws: list[torch.Tensor] = []
    taus: list[np.ndarray] = []
    if d > 0:
        for x, nz in zip(xs, noises, strict=True):
            ref = float(torch.linalg.matrix_norm(x, ord=2)) ** 2 if x.numel() else 0.0
            h = x - u_c @ (u_c.T @ x) if tall else x - (x @ v_c) @ v_c.T
            u, tau, w, kp = top(h, d, reference=ref, noise=nz)
            us.append(u)
            ws.append(w)
            taus.append(tau)
            kappas.append(kp)
    sig_all = np.concatenate([*taus, sig_c])
    mean = float(sig_all.mean()) if sig_all.size else 0.0
    pu, ru, ku = polar(torch.cat([*us, u_c], dim=1))
    pv, rv, kv = polar(torch.cat([*ws, v_c], dim=1))
    delta = (pu * (alpha * mean)) @ pv.T if ru and rv and mean else torch.zeros_like(xs[0])
    rank = min(ru, rv) if mean else 0
    stats = {
        "sigma_mean": float(f"{mean:.10g}"),
        "common_rank": int(sig_c.size),
        "task_ranks": [int(t.size) for t in taus] if taus else [0] * len(xs),
    }
    return SvdResult(delta, rank, max(*kappas, ku, kv), stats)
