"""The core space of several LoRA updates (pure float64 math).

Core Space (Panariello et al., NeurIPS 2025) merges LoRA experts without forming their ``m x n``
updates. Each update is a product ``Δ_i = L_i R_i`` (``L_i`` is ``m x r_i``, ``R_i`` is
``r_i x n``; for PEFT ``L_i = s_i·B_i`` and ``R_i = A_i``). With

- ``U``: the left singular vectors of the stacked ``[L_1 … L_T]`` (``m x k_L``, its numerical rank),
- ``V``: the right singular vectors of the stacked ``[R_1; …; R_T]`` (``n x k_R``),

each pair first **balanced** (:func:`balance`: ``L_i = U_i √S_i``, ``R_i = √S_i V_iᵀ`` from the SVD of
``L_i R_i``), so the bases depend on the updates alone, not on how an adapter splits its scale
between B and A, and a small adapter's directions are not lost beside a large one's (its
factors scale as the square root of its update);

every update lies in ``span(U) x span(V)``: ``Δ_i = U M_i Vᵀ`` exactly, with the core
``M_i = (Uᵀ L_i)(R_i V)`` (``k_L x k_R``, ``k ≤ Σ r_i``). A merge then runs on the cores and its
result ``M`` is the update ``U M Vᵀ``, written as LoRA factors (:func:`core_factors`).

- A merge that commutes with orthogonal changes of basis and does not depend on the matrix's
  size (task arithmetic, Iso-C, STAR, WUDI, SVC, a layer-wise strength) gives in the core space
  exactly what it gives on the full matrices: the core space is a lossless shortcut.
- An elementwise merge (TIES, DARE, Breadcrumbs, DELLA) gives a different merge: the one of the
  cores, in the singular bases of the stacked factors, as the Core Space paper defines it.

Cost ``O((m + n)(Σ r_i)²)`` per module; nothing of size ``m x n`` is formed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dghard_cli.spectral.lowrank import NUMERICAL_RANK_RTOL, Factors, factorize_product


@dataclass
class CoreSpace:
    """The shared bases of a module's updates and each update's core."""

    left: torch.Tensor  # U, m x k_L, orthonormal columns
    right: torch.Tensor  # V, n x k_R, orthonormal columns
    cores: list[torch.Tensor]  # M_i, k_L x k_R each

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.left.shape[1]), int(self.right.shape[1])


def _basis(x: torch.Tensor) -> torch.Tensor:
    """Left singular vectors of ``x`` (``m x c``) at its numerical rank."""
    if x.shape[1] == 0:
        return x.new_zeros((x.shape[0], 0))
    u, s, _ = torch.linalg.svd(x, full_matrices=False)
    if s.numel() == 0 or float(s[0]) <= 0.0:
        return x.new_zeros((x.shape[0], 0))
    k = int(torch.count_nonzero(s > NUMERICAL_RANK_RTOL * s[0]))
    return u[:, :k].contiguous()


def balance(left: torch.Tensor, right: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U √S, √S Vᵀ)`` from the SVD ``L R = U S Vᵀ``, every one of its ``r`` directions kept,
    without forming ``L R`` (thin QR of ``L`` and ``Rᵀ``, SVD of the ``r x r`` product of their
    triangles)."""
    if left.shape[1] == 0:
        return left, right
    qb, rb = torch.linalg.qr(left)
    qa, ra = torch.linalg.qr(right.T)
    u, sig, vh = torch.linalg.svd(rb @ ra.T)
    root = torch.sqrt(sig)
    return (qb @ u) * root, (root.unsqueeze(1) * (vh @ qa.T)).contiguous()


def core_space(lefts: Sequence[torch.Tensor], rights: Sequence[torch.Tensor]) -> CoreSpace:
    """The core space of the updates ``L_i R_i`` (float64; a zero update has a zero core)."""
    if len(lefts) != len(rights) or not lefts:
        raise ValueError("core_space needs one right factor per left factor, at least one")
    pairs = [balance(x.to(torch.float64), y.to(torch.float64)) for x, y in zip(lefts, rights, strict=True)]
    ls = [p[0] for p in pairs]
    rs = [p[1] for p in pairs]
    u = _basis(torch.cat(ls, dim=1))
    v = _basis(torch.cat(rs, dim=0).T)
    cores = [(u.T @ x) @ (y @ v) for x, y in zip(ls, rs, strict=True)]
    return CoreSpace(u, v, cores)


def core_factors(space: CoreSpace, merged: torch.Tensor, max_rank: int | None = None) -> Factors:
    """Exact LoRA factors of the update ``U M Vᵀ`` of a merged core ``M`` (SVD of the core,
    numerical rank, capped by ``max_rank``)."""
    m = merged.to(torch.float64)
    return factorize_product(space.left @ m, space.right.T, max_rank)
