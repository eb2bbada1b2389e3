"""Spectra of LoRA updates, and intruder dimensions: pure float64 math.

**Spectrum of ``scaling·B·A`` without forming it.** With the thin QR factorisations
``B = Q_B R_B`` (``m x r``) and ``Aᵀ = Q_A R_A`` (``n x r``), ``B·A = Q_B (R_B R_Aᵀ) Q_Aᵀ`` and the
outer factors have orthonormal columns, so the singular values of ``B·A`` are those of the
``r x r`` core ``R_B R_Aᵀ``. Cost ``O((m + n) r²)``; the ``m x n`` product is never built.

**Intruder dimensions** (Shuttleworth et al., "LoRA vs Full Fine-tuning: An Illusion of
Equivalence", arXiv 2410.21228, and PEFT's ``detect_intruder_dimensions``): with ``W0`` the base
weight and ``W = W0 + ΔW`` the adapted one, both in PEFT's ``out x in`` orientation, the
``j``-th of the top-``k`` left singular vectors ``y_j`` of ``W`` is an intruder when
``max_i |⟨u_i, y_j⟩| < ε``, the maximum running over the **whole pool of left singular vectors
of W0** — all ``min(m, n)`` of the thin SVD, not just the base's top ones: a fine-tuned top
direction that is the base's 50th direction moved up is not an intruder. Base singular values
below ``√(n·ε_64)·σ_max`` (zero to the Gram's precision, which only a rank-deficient base has)
have no defined singular vectors and are left out of the pool.

Computed exactly (up to float64 rounding) from Gram matrices on the matrix's smaller side, in one
streaming pass over ``W0``:

* ``m <= n``: ``G0 = W0 W0ᵀ`` and ``Gf = W Wᵀ = G0 + Z Pᵀ + P Zᵀ + P (Q Qᵀ) Pᵀ`` with
  ``ΔW = P Q``, ``Z = W0 Qᵀ``; the eigenvectors of ``G0`` are all of ``U0`` (``m x m``) and the top
  eigenvectors of ``Gf`` are the ``y_j``; cosines ``U0ᵀ Y``. ``W0`` is read by column blocks.
* ``m > n``: ``G0 = W0ᵀW0`` (``V0``, ``σ0``), ``Gf = WᵀW`` (``V``, ``σ``), ``C = W0ᵀW``; then
  ``u_iᵀ y_j = v0_iᵀ C v_j / (σ0_i σ_j)``. ``W0`` is read by row blocks, so a tall matrix (an
  embedding) is never in memory as float64.

DoRA scales the rows of ``W0 + ΔW`` to the learned magnitudes: ``W = diag(m / ‖W0 + ΔW‖_row)
(W0 + ΔW)``; both routes handle it (the row norms are the diagonal of ``Gf`` when ``m <= n``, and
come with each row block otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

EPS64 = 2.0**-52  # float64 machine epsilon (np.finfo(np.float64).eps)

#: blocks(axis) yields consecutive blocks of W0 (PEFT orientation, ``m x n``): row blocks for
#: axis 0, column blocks for axis 1, covering the matrix in order.
BlockSource = Callable[[int], Iterable["torch.Tensor"]]


# -- the spectrum of scaling·B·A ----------------------------------------------------------------------
@dataclass(frozen=True)
class LowRankSpectrum:
    """Singular values of ``scale·B·A`` (descending) and the factors' norms."""

    singular_values: np.ndarray
    scale: float
    b_fro: float
    b_two: float
    a_fro: float
    a_two: float

    @property
    def frobenius(self) -> float:
        return float(math.sqrt(float(np.sum(self.singular_values**2))))


def lowrank_spectrum(b: torch.Tensor, a: torch.Tensor, scale: float = 1.0) -> LowRankSpectrum:
    """Singular values of ``scale·B·A`` from QR of ``B`` (``m x r``) and ``Aᵀ`` (``n x r``).

    The product is never formed: ``σ(B·A) = σ(R_B R_Aᵀ)``, an ``r x r`` SVD. Computed in float64.
    """
    if b.ndim != 2 or a.ndim != 2 or b.shape[1] != a.shape[0]:
        raise ValueError(f"B {tuple(b.shape)} and A {tuple(a.shape)} do not form a product B·A")
    b64 = b.to(torch.float64)
    a64 = a.to(torch.float64)
    _, rb = torch.linalg.qr(b64, mode="r")
    _, ra = torch.linalg.qr(a64.T, mode="r")
    core = rb @ ra.T
    s = torch.linalg.svdvals(core).cpu().numpy() * abs(scale)
    sb = torch.linalg.svdvals(rb).cpu().numpy()
    sa = torch.linalg.svdvals(ra).cpu().numpy()
    return LowRankSpectrum(
        singular_values=np.sort(s)[::-1].copy(),
        scale=float(scale),
        b_fro=float(np.sqrt(np.sum(sb**2))),
        b_two=float(sb.max()) if sb.size else 0.0,
        a_fro=float(np.sqrt(np.sum(sa**2))),
        a_two=float(sa.max()) if sa.size else 0.0,
    )


def rounding_tolerance(spec: LowRankSpectrum, unit_roundoff: float) -> float:
    """How far rounding the stored factors to their dtype can move a singular value of scale·B·A.

    Rounding gives ``B + E_B``, ``A + E_A`` with ``‖E‖_F <= u‖·‖_F``, so the product moves by at
    most ``|scale|·u·(‖B‖_F‖A‖_2 + ‖B‖_2‖A‖_F)`` (first order) and so can each singular value.
    """
    return abs(spec.scale) * unit_roundoff * (spec.b_fro * spec.a_two + spec.b_two * spec.a_fro)


def effective_rank(s: np.ndarray) -> float:
    """Roy & Vetterli (2007) effective rank: ``exp(H(p))``, ``p_i = σ_i / Σσ``; 0 for a zero matrix."""
    s = np.asarray(s, dtype=np.float64)
    total = float(s.sum())
    if total <= 0:
        return 0.0
    p = s[s > 0] / total
    return float(np.exp(-np.sum(p * np.log(p))))


def spectrum_stats(spec: LowRankSpectrum, unit_roundoff: float) -> dict:
    """Norm, resolvable rank, effective rank and the top direction's energy share of scale·B·A."""
    s = spec.singular_values
    energy = float(np.sum(s**2))
    tol = rounding_tolerance(spec, unit_roundoff)
    return {
        "delta_norm": math.sqrt(energy),
        "numerical_rank": int(np.sum(s > tol)) if energy > 0 else 0,
        "rank_tolerance": tol,
        "effective_rank": effective_rank(s),
        "top_share": float(s[0] ** 2 / energy) if energy > 0 else None,
        "singular_values": [float(x) for x in s],
    }


# -- intruder dimensions ------------------------------------------------------------------------------
@dataclass
class IntruderResult:
    """Top-k singular directions of W0 + ΔW and their best |cosine| with W0's singular vectors."""

    k: int
    epsilon: float
    pool: int  # how many base left singular vectors were compared against
    sigma: list[float]  # top-k singular values of W0 + ΔW
    max_cos: list[float]  # best |cos| of each top-k left singular vector with the pool
    intruders: list[int]  # positions (0 = top) whose max_cos < epsilon
    base_norm: float  # ‖W0‖_F
    delta_norm: float  # ‖W − W0‖_F (with DoRA: of the rescaled weight)
    dora_scale: dict | None = field(default=None)  # min/median/max of m / ‖W0 + ΔW‖_row

    @property
    def count(self) -> int:
        return len(self.intruders)

    def to_dict(self) -> dict:
        return {
            "k": self.k,
            "epsilon": self.epsilon,
            "pool": self.pool,
            "count": self.count,
            "intruders": self.intruders,
            "sigma": self.sigma,
            "max_cos": self.max_cos,
            "base_norm": self.base_norm,
            "delta_norm": self.delta_norm,
            "dora_scale": self.dora_scale,
        }


def _top_eig(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (descending) and eigenvectors of a symmetric matrix."""
    g = (g + g.T) * 0.5
    lam, vec = torch.linalg.eigh(g)
    return lam.flip(0), vec.flip(1)


def _scale_stats(d: torch.Tensor) -> dict:
    d = d.detach().cpu().numpy()
    return {"min": float(d.min()), "median": float(np.median(d)), "max": float(d.max())}


def intruder_dimensions(
    blocks: BlockSource,
    shape: tuple[int, int],
    p: torch.Tensor,
    q: torch.Tensor,
    *,
    k: int = 10,
    epsilon: float = 0.5,
    magnitude: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> IntruderResult:
    """Intruder dimensions of ``W = W0 + P·Q`` (or its DoRA rescaling) against ``W0``.

    ``blocks`` streams ``W0`` (``m x n``, PEFT orientation); ``P`` is ``m x r``, ``Q`` is ``r x n``
    (for a LoRA module ``P = scaling·B``, ``Q = A``); ``magnitude`` (length ``m``) turns on DoRA.
    """
    m, n = shape
    if p.shape[0] != m or q.shape[1] != n or p.shape[1] != q.shape[0]:
        raise ValueError(f"P {tuple(p.shape)} · Q {tuple(q.shape)} does not match W0 {shape}")
    device = torch.device(device)
    p = p.to(device, torch.float64)
    q = q.to(device, torch.float64)
    mag = magnitude.to(device, torch.float64).reshape(-1) if magnitude is not None else None
    if mag is not None and mag.numel() != m:
        raise ValueError(f"magnitude has {mag.numel()} entries, W0 has {m} rows")
    tiny = torch.finfo(torch.float64).tiny
    k_eff = max(0, min(k, m, n))
    dora_scale = None

    if m <= n:
        g0 = torch.zeros((m, m), dtype=torch.float64, device=device)
        z = torch.zeros((m, p.shape[1]), dtype=torch.float64, device=device)
        col = 0
        for blk in blocks(1):
            wc = blk.to(device, torch.float64)
            c = wc.shape[1]
            g0.addmm_(wc, wc.T)
            z.addmm_(wc, q[:, col : col + c].T)
            col += c
        if col != n:
            raise ValueError(f"blocks covered {col} of {n} columns")
        qq = q @ q.T
        pqq = p @ qq
        gf = g0 + z @ p.T + p @ z.T + pqq @ p.T
        pz = (p * z).sum(dim=1)  # p_i · z_i = row i of W0 · row i of ΔW
        pqp = (pqq * p).sum(dim=1)  # ‖row i of ΔW‖²
        if mag is None:
            delta2 = float(pqp.sum())
        else:
            rown = torch.sqrt(torch.clamp(torch.diagonal(gf), min=0.0))
            d = mag / torch.clamp(rown, min=tiny)
            gf = d[:, None] * gf * d[None, :]
            dm1 = d - 1.0
            delta2 = float((dm1**2 * torch.diagonal(g0) + 2 * dm1 * d * pz + d**2 * pqp).sum())
            dora_scale = _scale_stats(d)
        base_norm = math.sqrt(max(float(torch.trace(g0)), 0.0))
        _, u0 = _top_eig(g0)
        lamf, uf = _top_eig(gf)
        sig_f = torch.sqrt(torch.clamp(lamf[:k_eff], min=0.0))
        cos = (u0.T @ uf[:, :k_eff]).abs()
        pool = m
    else:
        r = p.shape[1]
        g0 = torch.zeros((n, n), dtype=torch.float64, device=device)
        if mag is None:
            x = torch.zeros((n, r), dtype=torch.float64, device=device)
        else:
            gf = torch.zeros((n, n), dtype=torch.float64, device=device)
            cm = torch.zeros((n, n), dtype=torch.float64, device=device)
            delta2 = 0.0
            scales = []
        row = 0
        for blk in blocks(0):
            wb = blk.to(device, torch.float64)
            b = wb.shape[0]
            pb = p[row : row + b]
            g0.addmm_(wb.T, wb)
            if mag is None:
                x.addmm_(wb.T, pb)
            else:
                fb = torch.addmm(wb, pb, q)
                d = mag[row : row + b] / torch.clamp(torch.linalg.vector_norm(fb, dim=1), min=tiny)
                fb *= d[:, None]
                gf.addmm_(fb.T, fb)
                cm.addmm_(wb.T, fb)
                delta2 += float(((fb - wb) ** 2).sum())
                scales.append(d)
            row += b
        if row != m:
            raise ValueError(f"blocks covered {row} of {m} rows")
        if mag is None:
            xq = x @ q
            cm = g0 + xq
            ptp = p.T @ p
            gf = g0 + xq + xq.T + q.T @ ptp @ q
            delta2 = float((ptp * (q @ q.T)).sum())
        else:
            dora_scale = _scale_stats(torch.cat(scales))
        base_norm = math.sqrt(max(float(torch.trace(g0)), 0.0))
        lam0, v0 = _top_eig(g0)
        sig0 = torch.sqrt(torch.clamp(lam0, min=0.0))
        keep = sig0 > sig0[0] * math.sqrt(n * EPS64) if float(sig0[0]) > 0 else sig0 > 0
        lamf, vf = _top_eig(gf)
        sig_f = torch.sqrt(torch.clamp(lamf[:k_eff], min=0.0))
        num = v0[:, keep].T @ cm @ vf[:, :k_eff]
        den = sig0[keep][:, None] * torch.clamp(sig_f, min=tiny)[None, :]
        cos = (num / den).abs()
        pool = int(keep.sum())

    sig_list = [float(s) for s in sig_f.cpu()]
    if pool == 0 or k_eff == 0:
        max_cos = [0.0] * k_eff
    else:
        max_cos = [float(c) for c in cos.max(dim=0).values.cpu()]
    top = sig_list[0] if sig_list else 0.0
    defined = [s > top * math.sqrt(max(m, n) * EPS64) for s in sig_list]
    intruders = [j for j in range(k_eff) if defined[j] and max_cos[j] < epsilon]
    return IntruderResult(
        k=k_eff,
        epsilon=float(epsilon),
        pool=pool,
        sigma=sig_list,
        max_cos=max_cos,
        intruders=intruders,
        base_norm=base_norm,
        delta_norm=math.sqrt(max(delta2, 0.0)),
        dora_scale=dora_scale,
    )


def dense_blocks(w: torch.Tensor, rows: int = 1 << 30, cols: int = 1 << 30) -> BlockSource:
    """A :data:`BlockSource` over an in-memory matrix (tests, small tensors).

    Public in-memory API (the audit streams checkpoint tensors instead).
    """

    def gen(axis: int) -> Iterable[torch.Tensor]:
        if axis == 0:
            for r0 in range(0, w.shape[0], rows):
                yield w[r0 : r0 + rows]
        else:
            for c0 in range(0, w.shape[1], cols):
                yield w[:, c0 : c0 + cols]

    return gen
