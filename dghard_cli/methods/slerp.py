"""SLERP: spherical linear interpolation between BASE and one fine-tune, tensor by tensor.

Per tensor, with a = W_base and b = W_ft flattened (mergekit 0.1.5's definition):

    n_a = ‖a‖ (1 where ‖a‖ ≤ 1e-8), n_b likewise,   d = clamp(⟨a, b⟩ / (n_a·n_b), −1, 1)
    if |d| > 0.9995 (nearly colinear or antipodal):   W = (1 − t)·a + t·b        (linear)
    else, θ = arccos d:   W = sin((1 − t)·θ)/sin θ · a + sin(t·θ)/sin θ · b   (spherical)

t = 0 gives BASE, t = 1 the fine-tune. A fine-tune is usually nearly colinear with its base
(small Δ), so many tensors — norms and biases especially — take the linear rule, which is
WiSE-FT with α = t. The norms and the dot product are whole-tensor statistics, accumulated in
float64 over row blocks (one statistics pass); the result is written as
``W_base + (c_a + c_b − 1)·W_base + c_b·Δ`` so it fits the delta pipeline.

Everything here is a pure function of tensors or numbers, except :class:`SlerpKernel`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from dghard_cli.methods.merge_ops import BlockExact, Kernel
from dghard_cli.methods.registry import NUMBER, BuildContext, MergeMethod, Param, in_range

#: ``|cos| > DOT_THRESHOLD``: interpolate linearly (mergekit's threshold).
DOT_THRESHOLD = 0.9995
#: Norms at most this are taken as 1 (a zero tensor; mergekit's epsilon).
NORM_EPS = 1e-8


def slerp_coefficients(t: float, sq_a: float, sq_b: float, dot: float) -> tuple[float, float, float, bool]:
    """``(c_a, c_b, cos, linear)`` from ‖a‖², ‖b‖² and ⟨a, b⟩: W = c_a·a + c_b·b."""
    na = math.sqrt(sq_a)
    nb = math.sqrt(sq_b)
    na = na if na > NORM_EPS else 1.0
    nb = nb if nb > NORM_EPS else 1.0
    cos = min(1.0, max(-1.0, dot / (na * nb)))
    if abs(cos) > DOT_THRESHOLD:
        return 1.0 - t, t, cos, True
    theta = math.acos(cos)
    s = math.sin(theta)
    return math.sin((1.0 - t) * theta) / s, math.sin(t * theta) / s, cos, False


def slerp(base: torch.Tensor, ft: torch.Tensor, t: float) -> torch.Tensor:
    """SLERP of two whole tensors (statistics in float64, result in the inputs' dtype)."""
    a, b = base.to(torch.float64).reshape(-1), ft.to(torch.float64).reshape(-1)
    ca, cb, _, _ = slerp_coefficients(t, float(a @ a), float(b @ b), float(a @ b))
    return (ca * base.to(torch.float64) + cb * ft.to(torch.float64)).to(base.dtype)


class SlerpKernel(Kernel):
    """SLERP of BASE and one fine-tune: a statistics pass (norms, dot), then the interpolation."""

    def __init__(self, t: float) -> None:
        self.t = t
        self._sums = [0.0, 0.0, 0.0]  # ‖a‖², ‖b‖², ⟨a, b⟩
        self._seen = False
        self.coef: tuple[float, float, float, bool] | None = None

    def pending(self) -> bool:
        return not self._seen

    def observe(self, base: torch.Tensor, fts: Sequence[torch.Tensor]) -> None:
        a = base.reshape(-1).to(torch.float64)
        b = fts[0].reshape(-1).to(torch.float64)
        self._sums[0] += float(a @ a)
        self._sums[1] += float(b @ b)
        self._sums[2] += float(a @ b)

    def end_pass(self) -> None:
        self._seen = True
        self.coef = slerp_coefficients(self.t, *self._sums)

    def combine(self, base: torch.Tensor, deltas: list[torch.Tensor], exact: BlockExact) -> torch.Tensor:
        assert self.coef is not None
        ca, cb, _, linear = self.coef
        if linear:
            return deltas[0].mul_(cb)
        # c_a·a + c_b·(a + Δ) − a
        return deltas[0].mul_(cb).add_(base, alpha=ca + cb - 1.0)

    def stats(self) -> dict:
        assert self.coef is not None
        ca, cb, cos, linear = self.coef
        return {"slerp_rule": "linear" if linear else "spherical", "cosine": cos, "coefficients": [ca, cb]}


# -- declared for dghard merge (see dghard_cli.methods.registry) ------------------------------------


def _slerp_op(p: dict, ctx: BuildContext):
    from dghard_cli.methods.merge_ops import ElementwiseMergeOp

    return ElementwiseMergeOp(lambda job: SlerpKernel(p["t"]), ctx.device, ctx.block_bytes)


def _summary(rows: Iterable[dict], p: dict) -> dict:
    rules = [r.get("slerp_rule") for r in rows]
    return {"spherical_tensors": rules.count("spherical"), "linear_tensors": rules.count("linear")}


PARAMS = (
    Param(
        "t",
        NUMBER,
        "slerp: interpolation factor, 0 = BASE .. 1 = FT (default 0.5).",
        default=0.5,
        check=in_range(0.0, 1.0, "t", " (0 = BASE, 1 = the fine-tune)"),
        describe=lambda t: {"t": t, "dot_threshold": DOT_THRESHOLD},
        sweep_range=(0.0, 1.0),
    ),
)
MERGE_METHODS = (
    MergeMethod("slerp", ("t",), _slerp_op, fine_tunes="one", summary=_summary, sweep_axes=("t",)),
)
