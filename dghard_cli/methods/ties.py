"""TIES-merging (Yadav et al., 2023): trim, elect sign, disjoint mean.

Per tensor, with Δ_i = W_i − W_base and weights w_i ≥ 0:

1. **trim**: keep the ``k = max(1, ⌊density·n⌋)`` entries of Δ_i with the largest magnitude,
   zero the rest. The k-th largest magnitude is found by selection (``torch.kthvalue``,
   O(n)), never by sorting the tensor. Entries equal to the threshold are kept in row-major
   order until exactly k are kept, so the result is deterministic;
2. **elect**: the sign of ``Σ_i w_i·trim(Δ_i)`` per entry (zero counts as +);
3. **disjoint mean**: the w-weighted mean of the trimmed entries whose sign (of ``w_i·trim(Δ_i)``)
   equals the elected one — zeros never agree — or 0 where none agrees;
4. W = W_base + λ·(disjoint mean).

Everything here is a pure function of tensors, except :class:`TopKMask`, which applies a
selection to the row blocks of a tensor in order (it counts the threshold ties it kept).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def keep_count(numel: int, density: float) -> int:
    """How many entries a ``density`` keeps: ``max(1, ⌊density·n⌋)``; all for density ≥ 1."""
    if numel <= 0 or density <= 0:
        return 0
    if density >= 1:
        return numel
    return max(1, int(density * numel))


@dataclass(frozen=True)
class TopK:
    """An exact top-k selection by magnitude: the threshold and how many ties at it are kept."""

    k: int
    numel: int
    threshold: torch.Tensor  # 0-d, the k-th largest magnitude (same dtype as the magnitudes)
    above: int  # entries strictly above the threshold
    ties: int  # entries equal to the threshold
    ties_kept: int  # of those, the first ``ties_kept`` in row-major order are kept

    @property
    def all_ties(self) -> bool:
        return self.ties_kept == self.ties


def select_topk(magnitude: torch.Tensor, k: int) -> TopK:
    """Exact top-``k`` of a magnitude tensor (any shape, read in row-major order), no sort."""
    flat = magnitude.reshape(-1)
    n = flat.numel()
    if k <= 0 or n == 0:
        return TopK(0, n, flat.new_tensor(float("inf")), 0, 0, 0)
    k = min(k, n)
    threshold = torch.kthvalue(flat, n - k + 1).values if k < n else flat.min()
    above = int(torch.count_nonzero(flat > threshold))
    ties = int(torch.count_nonzero(flat == threshold))
    return TopK(k, n, threshold, above, ties, k - above)


class TopKMask:
    """Applies a :class:`TopK` to consecutive row blocks (row-major order) of the same tensor."""

    def __init__(self, sel: TopK) -> None:
        self.sel = sel
        self.ties_seen = 0
        self.kept = 0

    def __call__(self, magnitude: torch.Tensor) -> torch.Tensor:
        sel = self.sel
        t = sel.threshold.to(magnitude.device)
        if sel.k == 0:
            mask = torch.zeros_like(magnitude, dtype=torch.bool)
        elif sel.all_ties:
            mask = magnitude >= t
        else:
            mask = magnitude > t
            eq = magnitude == t
            n_eq = int(torch.count_nonzero(eq))
            quota = sel.ties_kept - self.ties_seen
            if quota > 0 and n_eq:
                rank = torch.cumsum(eq.reshape(-1), 0, dtype=torch.int64).reshape(eq.shape)
                mask |= eq & (rank <= quota)
            self.ties_seen += n_eq
        self.kept += int(torch.count_nonzero(mask))
        return mask


def topk_mask(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask of the exact top-``k`` magnitudes (ties: first in row-major order)."""
    return TopKMask(select_topk(magnitude, k))(magnitude)


def trim(delta: torch.Tensor, density: float) -> torch.Tensor:
    """Δ with all but its ``keep_count(n, density)`` largest-magnitude entries set to zero."""
    mask = topk_mask(delta.abs(), keep_count(delta.numel(), density))
    return torch.where(mask, delta, torch.zeros((), dtype=delta.dtype, device=delta.device))


def elect_sign(trimmed: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """+1/−1 per entry: the sign of ``Σ_i w_i·trimmed_i``, zero counting as +1."""
    total = trimmed[0] * weights[0]
    for t, w in zip(trimmed[1:], weights[1:], strict=True):
        total.add_(t, alpha=w)
    one = torch.ones((), dtype=total.dtype, device=total.device)
    return torch.where(total >= 0, one, -one)


def agreeing(trimmed: torch.Tensor, weight: float, sign: torch.Tensor) -> torch.Tensor:
    """Entries of ``weight·trimmed`` that are non-zero with the elected sign."""
    if weight == 0:
        return torch.zeros_like(trimmed, dtype=torch.bool)
    s = sign if weight > 0 else -sign
    return (trimmed * s) > 0


def disjoint_mean(
    trimmed: Sequence[torch.Tensor], weights: Sequence[float], sign: torch.Tensor
) -> torch.Tensor:
    """``Σ_i w_i·t_i·[agree_i] / Σ_i w_i·[agree_i]`` per entry, 0 where nothing agrees."""
    num = torch.zeros_like(trimmed[0])
    den = torch.zeros_like(trimmed[0])
    zero = torch.zeros((), dtype=num.dtype, device=num.device)
    for t, w in zip(trimmed, weights, strict=True):
        ok = agreeing(t, w, sign)
        num.add_(torch.where(ok, t, zero), alpha=w)
        den.add_(ok.to(den.dtype), alpha=w)
    return torch.where(den != 0, num / torch.where(den != 0, den, 1), zero)


def sign_conflicts(trimmed: Sequence[torch.Tensor]) -> int:
    """Entries where two trimmed deltas are non-zero with opposite signs."""
    pos = torch.zeros_like(trimmed[0], dtype=torch.bool)
    neg = torch.zeros_like(trimmed[0], dtype=torch.bool)
    for t in trimmed:
        pos |= t > 0
        neg |= t < 0
    return int(torch.count_nonzero(pos & neg))


def ties_delta(
    trimmed: Sequence[torch.Tensor], weights: Sequence[float], lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sign election and disjoint mean of already trimmed (or DARE-dropped) deltas, times λ.

    Returns (merged delta, elected sign).
    """
    sign = elect_sign(trimmed, weights)
    out = disjoint_mean(trimmed, weights, sign)
    if lam != 1.0:
        out.mul_(lam)
    return out, sign


def ties_merge(
    base: torch.Tensor,
    fts: Sequence[torch.Tensor],
    weights: Sequence[float],
    density: float,
    lam: float = 1.0,
) -> torch.Tensor:
    """TIES on whole tensors: ``W_base + λ·disjoint_mean(elect(trim(Δ_i)))``."""
    trimmed = [trim(f - base, density) for f in fts]
    merged, _ = ties_delta(trimmed, weights, lam)
    return base + merged
