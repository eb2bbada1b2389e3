"""The strengths of a weighted merge, as the accumulation in a given dtype can apply them.

A merge ``λ·Σ_i w_i·Δ_i`` (task arithmetic; TIES' election and disjoint mean or sum) runs in the
work dtype of its inputs, often float32. torch refuses an ``add_(x, alpha=w)`` whose ``w`` the
tensor's dtype cannot hold ("value cannot be converted to type float without overflow", exit 3),
so ``--weights 1,1e300`` crashed while ``--weights 1e300,1`` (the first weight is a multiply) was
refused properly, and ``--weights 1e300,1e300 --lambda 1e-300``, a finite merge (λ·w = 1),
crashed too. The strengths are therefore taken as a whole: where a weight or λ is beyond the work
dtype's range, the weights are divided by their largest magnitude ``m`` (exact scaling in
float64) and λ multiplied by it (the effective coefficient ``λ·w_i`` of each task vector is
unchanged; a normalised mean does not depend on the weights' scale at all). What still
overflows is a merge whose values are truly beyond the range: the callers' range checks refuse
it with the tensor's name (exit 2). Strengths within range are returned as given: the same bits
as always.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dghard_cli.errors import InputError


def effective_strengths(
    weights: Sequence[float], lam: float, dtype: torch.dtype, *, scale_free: bool = False
) -> tuple[list[float], float]:
    """``(weights, λ)`` that an accumulation in ``dtype`` can apply, with the same effective
    coefficients ``λ·w_i``; ``scale_free``: the result does not depend on the weights' scale
    (a weighted mean, the sign of a weighted sum), so λ stays as given. Weights that are not
    values of ``dtype`` (beyond its largest, or below its smallest subnormal:
    ``--weights 1e-300,1e-300 --lambda 1e300``) are rescaled; weights
    whose ratio ``dtype`` cannot hold (1e300 beside 1 in float32: the small one would vanish
    without a word) are an InputError."""
    ws = [float(w) for w in weights]
    info = torch.finfo(dtype) if dtype.is_floating_point else None
    if info is None:
        return ws, lam
    lowest = info.tiny * info.eps  # the smallest subnormal: a smaller weight rounds to 0 in dtype
    mags = [abs(w) for w in ws if w != 0.0]
    if not mags or all(lowest <= a <= info.max for a in mags):
        return ws, lam  # every weight is a value of dtype (subnormal ones included): as given
    m = max(mags)  # finite: the options refuse NaN and Inf
    scaled = [w / m for w in ws]
    if min(abs(w) for w in scaled if w != 0.0) < lowest:
        raise InputError(
            f"--weights {','.join(f'{w:g}' for w in ws)}: the smallest weight is less than {lowest:.3g} "
            f"of the largest, a ratio {dtype} cannot hold, so its task vector would vanish from the merge; "
            "give weights within that ratio (or set the small one to 0)"
        )
    return scaled, lam if scale_free else lam * m
