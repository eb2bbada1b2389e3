"""Task arithmetic (Ilharco et al., 2023): a weighted sum of task vectors.

    W = W_base + λ·Σ_i w_i·Δ_i,   Δ_i = W_i − W_base.

Negative weights subtract a task vector (negation, "forgetting" a task on purpose).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dghard_cli.methods.coefficients import effective_strengths


def weighted_sum(
    deltas: Sequence[torch.Tensor], weights: Sequence[float], *, overwrite: bool = False
) -> torch.Tensor:
    """``Σ_i w_i·Δ_i``: a new tensor, the inputs unmodified; with ``overwrite`` accumulated into
    ``deltas[0]`` (the caller's own, which then holds the sum: the same numbers, one tensor
    fewer to allocate)."""
    if len(deltas) != len(weights) or not deltas:
        raise ValueError("one weight per delta, at least one delta")
    if overwrite:
        out = deltas[0] if weights[0] == 1.0 else deltas[0].mul_(weights[0])  # x·1 is x
    else:
        out = deltas[0] * weights[0]
    for d, w in zip(deltas[1:], weights[1:], strict=True):
        out.add_(d, alpha=w)
    return out


def task_arithmetic_delta(
    deltas: Sequence[torch.Tensor], weights: Sequence[float], lam: float, *, overwrite: bool = False
) -> torch.Tensor:
    """The merged delta ``λ·Σ_i w_i·Δ_i`` (add it to W_base; ``overwrite``: see
    :func:`weighted_sum`)."""
    weights, lam = effective_strengths(weights, lam, deltas[0].dtype)
    out = weighted_sum(deltas, weights, overwrite=overwrite)
    if lam != 1.0:
        out.mul_(lam)
    return out
