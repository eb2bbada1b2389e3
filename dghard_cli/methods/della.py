"""DELLA (Deep et al., 2024): magnitude-ranked random drop ("MagPrune"), then rescale.

Per row of Δ_i = W_i − W_base (a 2-D tensor's rows, a 1-D tensor as one row, a ≥3-D tensor
along its second axis — mergekit 0.1.5's axis), the m entries are ranked by magnitude
(r = 0 for the smallest … m − 1 for the largest; equal magnitudes by position) and entry j
is kept with probability

    p_j = (density − ε) + 2ε·r_j/(m − 1)        (p_j = density when m = 1)

— from density − ε for the smallest to density + ε for the largest, density on average —
and divided by its own p_j if kept (the paper's rescale: the expected delta is unchanged;
an IEEE float64 division rounded once). density = 1 keeps Δ whole. Then

- ``della``:        W = W_base + λ·disjoint(elect(DELLA(Δ_i))), the disjoint mean by default
  (mergekit's ``normalize: true``), the sum with ``normalize: false``;
- ``della-linear``: W = W_base + λ·Σ_i w_i·DELLA(Δ_i).

**The random stream** is DARE's, in its own domain: u_j ∈ [0, 1) (float32) depends only on
(seed, tensor name, fine-tune index, position). The flattened tensor is cut into chunks of
``CHUNK`` entries and chunk c draws ``torch.rand`` from a CPU ``torch.Generator`` seeded with
BLAKE2b("dghard-della", seed, name, index, c); entry j is kept iff u_j < p_j (p_j in float64).
So the output does not depend on processing order, row blocks, shard layout, device or resume.

mergekit draws its mask with ``torch.bernoulli`` from the global generator (order dependent)
and rescales by the ratio of L1 norms, so the two agree in distribution, not entry by entry.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dghard_cli.errors import InputError
from dghard_cli.methods.builtin import kept_summary, nonnegative_weights
from dghard_cli.methods.dare import CHUNK
from dghard_cli.methods.dare import uniforms as dare_uniforms
from dghard_cli.methods.merge_ops import BlockExact, Kernel, _Election, per_ft
from dghard_cli.methods.registry import NUMBER, BuildContext, MergeMethod, Param, finite
from dghard_cli.methods.task_arithmetic import task_arithmetic_delta


def uniforms(seed: int, name: str, index: int, numel: int, start: int, stop: int) -> torch.Tensor:
    """u_j for flat positions ``[start, stop)`` of the tensor (CPU float32): DARE's stream in
    the ``dghard-della`` domain."""
    return dare_uniforms(seed, name, index, numel, start, stop, domain="dghard-della")


def keep_probabilities(delta: torch.Tensor, density: float, epsilon: float) -> torch.Tensor:
    """p_j per entry (float64, Δ's shape): ranked along axis 1 (1-D: the whole vector)."""
    x = delta.reshape(1, -1) if delta.dim() == 1 else delta
    m = x.shape[1] if x.dim() > 1 else 1
    if x.numel() == 0:
        return torch.zeros(delta.shape, dtype=torch.float64, device=delta.device)
    if m == 1:
        return torch.full(delta.shape, density, dtype=torch.float64, device=delta.device)
    order = torch.argsort(x.abs(), dim=1, stable=True)
    shape = [1] * x.dim()
    shape[1] = m
    steps = torch.arange(m, dtype=torch.float64, device=x.device).reshape(shape).expand_as(order)
    rank = torch.empty(x.shape, dtype=torch.float64, device=x.device).scatter_(1, order, steps)
    return rank.mul_(2 * epsilon / (m - 1)).add_(density - epsilon).reshape(delta.shape)


def magprune(
    delta: torch.Tensor, u: torch.Tensor, density: float, epsilon: float
) -> tuple[torch.Tensor, int]:
    """(DELLA(Δ), kept count) given the uniforms ``u`` of Δ's entries (flat, row-major)."""
    if density >= 1:
        return delta, delta.numel()
    p = keep_probabilities(delta, density, epsilon)
    keep = u.reshape(delta.shape).to(device=delta.device, dtype=torch.float64) < p
    out = torch.div(delta.to(torch.float64), p).to(delta.dtype).masked_fill_(~keep, 0)
    return out, int(torch.count_nonzero(keep))


def della(
    delta: torch.Tensor, density: float, epsilon: float, seed: int, name: str, index: int = 0
) -> torch.Tensor:
    """DELLA on a whole tensor, with the random stream of (seed, name, index)."""
    n = delta.numel()
    return magprune(delta, uniforms(seed, name, index, n, 0, n), density, epsilon)[0]


class DellaKernel(Kernel):
    """DELLA on each delta block (rows are whole in a block), then TIES' election or a sum."""

    #: MAGPRUNE ranks the magnitudes of each row: blocks hold whole rows, never flat pieces of one
    needs_rows = True

    def __init__(
        self,
        weights: Sequence[float],
        lam: float,
        density: float | Sequence[float],
        epsilon: float,
        seed: int,
        name: str,
        numel: int,
        *,
        ties: bool,
        normalize: bool = True,
    ) -> None:
        self.weights, self.lam = list(weights), lam
        self.density = per_ft(density, len(self.weights))  # per fine-tune
        self.epsilon, self.seed, self.name = epsilon, seed, name
        self.numel = numel
        self.pos = 0
        self.kept = [0] * len(self.weights)
        self.election = _Election(weights, lam, normalize=normalize) if ties else None

    def combine(self, base: torch.Tensor, deltas: list[torch.Tensor], exact: BlockExact) -> torch.Tensor:
        n = deltas[0].numel()
        pruned = []
        for i, d in enumerate(deltas):
            u = uniforms(self.seed, self.name, i, self.numel, self.pos, self.pos + n)
            out, kept = magprune(d, u, self.density[i], self.epsilon)
            self.kept[i] += kept
            pruned.append(out)
        self.pos += n
        if self.election is not None:
            return self.election(pruned, self.work)
        return task_arithmetic_delta(pruned, self.weights, self.lam, overwrite=True)

    def stats(self) -> dict:
        out = {"kept": self.kept, "kept_fraction": [k / self.numel if self.numel else 0.0 for k in self.kept]}
        if self.election is not None:
            out.update(self.election.stats())
        return out


# -- declared for dghard merge (see dghard_cli.methods.registry) ------------------------------------

RANDOM_STREAM = (
    f"torch.Generator(CPU) per {CHUNK}-entry chunk, "
    "seeded by BLAKE2b('dghard-della', seed, name, index, chunk)"
)


def _check_epsilon(p: dict, n_fts: int) -> None:
    """Keep probabilities density ± epsilon in (0, 1) for every fine-tune's density below 1."""
    eps = p["epsilon"]
    bad = [d for d in per_ft(p["density"], n_fts) if d < 1 and not (d - eps > 0 and d + eps < 1)]
    if eps < 0 or bad:
        d = bad[0] if bad else p["density"]
        raise InputError(
            f"--epsilon {eps} with --density {d}: keep probabilities density ± epsilon must lie in "
            "(0, 1); use epsilon >= 0 below min(density, 1 − density)"
        )


def _della_op(ties: bool):
    def make(p: dict, ctx: BuildContext):
        from dghard_cli.methods.merge_ops import ElementwiseMergeOp, merged_numel

        # ranking a block's rows needs ~4 float64/int64 temporaries per entry: smaller blocks
        return ElementwiseMergeOp(
            lambda job: DellaKernel(
                p["weights"],
                p["lambda"],
                p["density"],
                p["epsilon"],
                p["seed"],
                job.name,
                merged_numel(job),
                ties=ties,
                normalize=p.get("normalize", True),
            ),
            ctx.device,
            max(1, ctx.block_bytes // 4),
        )

    return make


PARAMS = (
    Param(
        "epsilon",
        NUMBER,
        "della: keep probabilities range over density ± epsilon by magnitude (default 0.15).",
        default=0.15,
        check=lambda value, method, n_fts: finite("epsilon", value),
        # after ``seed`` in a method's parameters: DELLA's stream replaces DARE's in the report
        describe=lambda eps: {"epsilon": eps, "random_stream": RANDOM_STREAM},
    ),
)
_TAKES = ("weights", "lambda", "density", "seed", "epsilon")
_SWEEP = {
    "sweep_axes": ("density", "lambda"),
    "sweep_fixed": ("weights", "density", "epsilon", "lambda", "seed"),
}
MERGE_METHODS = (
    MergeMethod(
        "della",
        (*_TAKES, "normalize"),
        _della_op(ties=True),
        summary=kept_summary(conflicts=True),
        check_weights=nonnegative_weights,
        defaults={"density": 0.5},
        check_params=_check_epsilon,
        core_space="cores",
        **_SWEEP,
    ),
    MergeMethod(
        "della-linear",
        _TAKES,
        _della_op(ties=False),
        summary=kept_summary(conflicts=False),
        defaults={"density": 0.5},
        check_params=_check_epsilon,
        core_space="cores",
        **_SWEEP,
    ),
)
