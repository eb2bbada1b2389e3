"""WiSE-FT (Wortsman et al., 2022): linear interpolation between the base and one fine-tune.

    W = (1 − α)·W_base + α·W_ft = W_base + α·Δ,   Δ = W_ft − W_base.

α = 0 gives the base, α = 1 the fine-tune. Computed on the delta (``W_base + α·Δ``), which is
the same number as the interpolation up to rounding of the work dtype.
"""

from __future__ import annotations

import torch


def wise_ft_delta(delta: torch.Tensor, alpha: float, *, overwrite: bool = False) -> torch.Tensor:
    """The merged delta ``α·Δ`` (add it to W_base); ``overwrite``: in ``delta`` (the caller's own)."""
    return delta.mul_(alpha) if overwrite else delta * alpha
