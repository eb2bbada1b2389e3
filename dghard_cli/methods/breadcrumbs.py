"""Model Breadcrumbs (Davari & Belilovsky, 2023): drop each delta's largest *and* smallest entries.

Per tensor of n entries, Δ_i = W_i − W_base, with ``density`` D and ``gamma`` γ (mergekit
0.1.5's ``magnitude_outliers``):

    keep = ⌊D·n⌋,   top = ⌊γ·n⌋,   bottom = max(0, n − keep − top),   dropped_top = n − bottom − keep

The entries ranked ``dropped_top + 1 … dropped_top + keep`` by magnitude (largest first) are
kept, the rest zeroed: the ``dropped_top`` largest (the outliers; fewer than ⌊γ·n⌋ when the
density leaves no room) and the ``bottom`` smallest go. D ≥ 1 keeps Δ whole (no outlier is
removed either, as in mergekit). Ranks follow TIES' order — larger exact magnitude first, then
row-major position — so the kept set is deterministic where mergekit's sort is not.

- ``breadcrumbs``:      W = W_base + λ·Σ_i w_i·BC(Δ_i)
- ``breadcrumbs-ties``: W = W_base + λ·disjoint(elect(BC(Δ_i))), the disjoint *sum* by default
  (mergekit's ``normalize: false``), the disjoint mean with ``normalize``.

The mask is ``top-(dropped_top + keep)`` minus ``top-(dropped_top)``: two exact top-k
selections (:mod:`dghard_cli.methods.topk_stream`) that share their statistics passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dghard_cli.engine.scratch import Scratch
from dghard_cli.errors import InputError
from dghard_cli.methods import ties as T
from dghard_cli.methods.builtin import kept_summary, nonnegative_weights
from dghard_cli.methods.merge_ops import BlockExact, Kernel, _Election, per_ft
from dghard_cli.methods.registry import NUMBER, BuildContext, MergeMethod, Param
from dghard_cli.methods.task_arithmetic import task_arithmetic_delta
from dghard_cli.methods.topk_stream import StreamingTopK


def breadcrumbs_counts(numel: int, density: float, gamma: float) -> tuple[int, int]:
    """``(dropped_top, keep)``: how many of the largest entries go, how many after them stay."""
    if density >= 1:
        return 0, numel
    keep = int(density * numel)
    top = int(gamma * numel)
    bottom = max(0, numel - keep - top)
    return numel - bottom - keep, keep


def breadcrumbs_mask(
    magnitude: torch.Tensor, density: float, gamma: float, exact: T.ExactMagnitudes | None = None
) -> torch.Tensor:
    """The kept entries of a whole magnitude tensor (ranks: larger exact magnitude, then position)."""
    dropped, keep = breadcrumbs_counts(magnitude.numel(), density, gamma)
    outer = T.topk_mask(magnitude, dropped + keep, exact)
    if dropped:
        outer &= ~T.topk_mask(magnitude, dropped, exact)
    return outer


def breadcrumbs(delta: torch.Tensor, density: float, gamma: float) -> torch.Tensor:
    """Δ with its outliers and its smallest entries zeroed (whole tensor)."""
    mask = breadcrumbs_mask(delta.abs(), density, gamma)
    return torch.where(mask, delta, torch.zeros((), dtype=delta.dtype, device=delta.device))


class BreadcrumbsKernel(Kernel):
    """Breadcrumbs masks of every delta (statistics passes), then a weighted sum or TIES' election."""

    def __init__(
        self,
        weights: Sequence[float],
        lam: float,
        density: float | Sequence[float],
        gamma: float,
        numel: int,
        *,
        ties: bool,
        normalize: bool = False,
    ) -> None:
        self.weights, self.lam = list(weights), lam
        self.numel = numel
        counts = [breadcrumbs_counts(numel, d, gamma) for d in per_ft(density, len(self.weights))]
        self.dropped = [c[0] for c in counts]  # per fine-tune
        self.keep = [c[1] for c in counts]
        self.election = _Election(weights, lam, normalize=normalize) if ties else None
        self.outer: list[StreamingTopK] = []
        self.inner: list[StreamingTopK] = []

    def begin(self, dtype: torch.dtype, *, whole: bool, work: Scratch | None = None) -> None:
        super().begin(dtype, whole=whole, work=work)
        pairs = zip(self.dropped, self.keep, strict=True)
        self.outer = [StreamingTopK(self.numel, dropped + keep, dtype) for dropped, keep in pairs]
        self.inner = [StreamingTopK(self.numel, dropped, dtype) for dropped in self.dropped]

    def _all(self) -> list[StreamingTopK]:
        return [*self.outer, *self.inner]

    def pending(self) -> bool:
        return any(s.pending for s in self._all())

    def observe(self, base: torch.Tensor, fts: list[torch.Tensor]) -> None:
        b = base.reshape(-1)
        for i, ft in enumerate(fts):
            f = ft.reshape(-1)
            sels = [s for s in (self.outer[i], self.inner[i]) if s.pending]
            if not sels:
                continue
            mag = torch.sub(f, b).abs_()

            def exact(pos: torch.Tensor, f: torch.Tensor = f) -> torch.Tensor:
                return (f[pos].double() - b[pos].double()).abs()

            for s in sels:
                s.observe(mag, exact)

    def end_pass(self) -> None:
        for s in self._all():
            if s.pending:
                s.end_pass()

    def combine(self, base: torch.Tensor, deltas: list[torch.Tensor], exact: BlockExact) -> torch.Tensor:
        for i, d in enumerate(deltas):
            mag = d.abs()

            def ex(pos: torch.Tensor, i: int = i) -> torch.Tensor:
                return exact(i, pos)

            keep = self.outer[i].mask(mag, ex)
            if self.dropped[i]:
                keep &= ~self.inner[i].mask(mag, ex)
            d.masked_fill_(~keep, 0)
        if self.election is not None:
            return self.election(deltas, self.work)
        return task_arithmetic_delta(deltas, self.weights, self.lam, overwrite=True)

    def stats(self) -> dict:
        kept = [o.kept - i.kept for o, i in zip(self.outer, self.inner, strict=True)]
        out = {
            "kept": kept,
            "kept_fraction": [k / self.numel if self.numel else 0.0 for k in kept],
            "dropped_top": self.dropped,
        }
        if self.election is not None:
            out.update(self.election.stats())
        return out


# -- declared for dghard merge (see dghard_cli.methods.registry) ------------------------------------


def _check_gamma(value: Any, method: MergeMethod, n_fts: int) -> float:
    from dghard_cli.methods.registry import finite

    gamma = finite("gamma", value)
    if not 0.0 <= gamma < 1.0:
        raise InputError(
            f"--gamma is the fraction of largest entries dropped and must be in [0, 1), got {gamma}"
        )
    return gamma


def _breadcrumbs_op(ties: bool):
    def make(p: dict, ctx: BuildContext):
        from dghard_cli.methods.merge_ops import ElementwiseMergeOp, merged_numel

        return ElementwiseMergeOp(
            lambda job: BreadcrumbsKernel(
                p["weights"],
                p["lambda"],
                p["density"],
                p["gamma"],
                merged_numel(job),
                ties=ties,
                normalize=p.get("normalize", False),
            ),
            ctx.device,
            ctx.block_bytes,
        )

    return make


PARAMS = (
    Param(
        "gamma",
        NUMBER,
        "breadcrumbs: fraction of the largest entries dropped (default 0.01).",
        default=0.01,
        check=_check_gamma,
        sweep_range=(0.0, 0.1),
    ),
)
_TAKES = ("weights", "lambda", "density", "gamma")
_SWEEP = {"sweep_axes": ("density", "lambda"), "sweep_fixed": ("weights", "density", "gamma", "lambda")}
MERGE_METHODS = (
    MergeMethod(
        "breadcrumbs",
        _TAKES,
        _breadcrumbs_op(ties=False),
        summary=kept_summary(conflicts=False),
        defaults={"density": 0.9},
        core_space="cores",
        **_SWEEP,
    ),
    MergeMethod(
        "breadcrumbs-ties",
        (*_TAKES, "normalize"),
        _breadcrumbs_op(ties=True),
        summary=kept_summary(conflicts=True),
        check_weights=nonnegative_weights,
        defaults={"density": 0.9, "normalize": False},  # mergekit's: the disjoint sum
        core_space="cores",
        **_SWEEP,
    ),
)
