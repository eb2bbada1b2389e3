"""Strengths of DoRA adapters written exactly as DoRA: pure float64 math.

PEFT's DoRA layer (Linear) gives ``W_k = diag(d_k)(W + Δ_k)`` with ``Δ_k = s_k·B_k·A_k`` and
``d_k = m_k / ‖W + Δ_k‖_row`` (one norm per output row). A method linear in the task vectors
asks for ``W_t = W + Σ_k c_k (W_k − W)``; a plain LoRA input is the case ``d_k = 1``. Row ``i``
of the target is

    W_t[i] = g_i·W[i] + Σ_k c_k d_k[i] Δ_k[i],      g_i = 1 + Σ_k c_k (d_k[i] − 1),

which is again one DoRA layer, exactly:

- ``B' = [diag(c_1 d_1 / g) s_1 B_1, diag(c_2 d_2 / g) s_2 B_2, …]``, ``A' = [A_1; A_2; …]``
  (rank Σ r_k, scaling 1): each row of each B is scaled, not the whole B;
- ``m' = g ⊙ ‖W + B'A'‖_row``, so that ``diag(m' / ‖W + B'A'‖_row)(W + B'A') = W_t``.

Scaling B by ``c`` and keeping the magnitude vector (``m' = m``) would not do: the row norms
``‖W + c·Δ‖`` then differ from ``‖W + Δ‖`` and the rows' lengths change with them; neither does
scaling B by ``c`` and recomputing ``m`` alone, because the direction of ``W_t[i]`` is
``W[i] + (c d_i / g_i)·Δ[i]``, not ``W[i] + c·Δ[i]``, unless ``d_i = 1`` or ``c = 1``.

A row whose ``g_i`` is 0 has no direction along ``W[i]`` (the strengths cancel the base row) and
cannot be written as DoRA: :class:`DoraCancelled` says which. ``--rank R`` below Σ r_k truncates
``B'A'`` with the exact SVD and keeps each row's exact length; the energy lost is then measured
on the layer, ``‖W_out − W_t‖² / ‖W_t − W‖²``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dghard_cli.spectral.lowrank import factorize_product

#: |g_i| below this (relative to the largest |g|) is a cancelled row.
CANCEL_RTOL = 1e-9
#: rows of W handled at a time (float64)
BLOCK_BYTES = 32 * 1024 * 1024


class DoraCancelled(ValueError):
    """The strengths cancel a base row (``g_i = 0``): the result is not a DoRA layer."""

    def __init__(self, row: int) -> None:
        super().__init__(f"row {row}")
        self.row = row


@dataclass(frozen=True)
class DoraPart:
    """One input's update of the module: coefficient ``c``, ``s·B`` (``m x r``), ``A`` (``r x n``),
    and its magnitude vector (None for a plain LoRA input)."""

    c: float
    sb: torch.Tensor
    a: torch.Tensor
    magnitude: torch.Tensor | None


@dataclass(frozen=True)
class DoraResult:
    """The written DoRA module: scaling-1 factors and the magnitude vector, float64."""

    b: torch.Tensor
    a: torch.Tensor
    magnitude: torch.Tensor
    update_energy: float  # ‖W_t − W‖²
    energy_lost: float  # ‖W_out − W_t‖² / ‖W_t − W‖² (0 without a rank cut)
    numerical_rank: int  # of B'A' (the factors' concatenation)
    cut: bool  # --rank truncated B'A'


def _row_steps(m: int, n: int) -> list[tuple[int, int]]:
    step = max(1, BLOCK_BYTES // max(1, 8 * n))
    return [(r, min(m, r + step)) for r in range(0, m, step)]


def combine(
    w_rows: Callable[[tuple[int, int]], torch.Tensor],
    shape: tuple[int, int],
    parts: list[DoraPart],
    rank: int | None = None,
) -> DoraResult:
    """The DoRA module equal to ``W + Σ c_k (W_k − W)`` (module docstring); ``w_rows((r0, r1))``
    gives rows of the base weight ``W`` (``m x n``). ``rank``: truncate ``B'A'`` to it."""
    m, n = shape
    a = torch.cat([p.a.to(torch.float64) for p in parts], dim=0)
    b = torch.empty((m, a.shape[0]), dtype=torch.float64)
    g = torch.empty(m, dtype=torch.float64)
    for r0, r1 in _row_steps(m, n):
        w = w_rows((r0, r1)).to(torch.float64)
        gb = torch.ones(r1 - r0, dtype=torch.float64)
        scales = []
        for p in parts:
            sb = p.sb[r0:r1].to(torch.float64)
            if p.magnitude is None:
                d = torch.ones(r1 - r0, dtype=torch.float64)
            else:
                d = p.magnitude[r0:r1].to(torch.float64).reshape(-1) / torch.linalg.vector_norm(
                    w + sb @ p.a.to(torch.float64), dim=1
                )
            gb += p.c * (d - 1.0)
            scales.append((p.c * d, sb))
        g[r0:r1] = gb
        col = 0
        for cd, sb in scales:
            k = sb.shape[1]
            b[r0:r1, col : col + k] = sb * cd.unsqueeze(1)
            col += k
    top = float(g.abs().max()) if m else 0.0
    small = torch.nonzero(g.abs() <= CANCEL_RTOL * max(top, 1.0)).reshape(-1)
    if small.numel():
        raise DoraCancelled(int(small[0]))
    b /= g.unsqueeze(1)
    exact = factorize_product(b, a)
    numerical = exact.numerical_rank
    cut = rank is not None and a.shape[0] > rank and numerical > rank
    b_out, a_out = b, a
    if cut:
        fac = factorize_product(b, a, rank)
        b_out, a_out = fac.left, fac.right
    mag = torch.empty(m, dtype=torch.float64)
    update2 = lost2 = 0.0
    for r0, r1 in _row_steps(m, n):
        w = w_rows((r0, r1)).to(torch.float64)
        full = w + b[r0:r1] @ a  # the exact direction
        gm = g[r0:r1]
        mag[r0:r1] = gm * torch.linalg.vector_norm(full, dim=1)
        target = full * gm.unsqueeze(1)
        update2 += float(torch.sum((target - w) ** 2))
        if cut:
            kept = w + b_out[r0:r1] @ a_out
            out = kept * (mag[r0:r1] / torch.linalg.vector_norm(kept, dim=1)).unsqueeze(1)
            lost2 += float(torch.sum((out - target) ** 2))
    lost = lost2 / update2 if update2 > 0 else 0.0
    return DoraResult(b_out, a_out, mag, update2, lost, numerical, cut)
