"""STAR and CART: merges that keep a low-rank part of each task vector.

Per eligible weight matrix (m × n), with T fine-tunes and Δ_i = W_i − W_base:

**STAR**, Spectral Truncation and Rescale (NAACL 2025, arXiv 2502.10339): each
Δ_i = U·diag(σ)·Vᵀ keeps its top r_i singular directions, r_i the smallest r whose singular
values reach η % of their sum (the nuclear norm; ``--eta``, default 40 as in the paper's code),
rescaled so that the nuclear norm is unchanged (σ'_j = σ_j·Σ_all σ / Σ_{j≤r} σ); the merge is
their average, times ``--alpha`` (default 1, the paper's):

    W = W_base + α·(1/T)·Σ_i U_{r_i}·diag(σ'_i)·V_{r_i}ᵀ

**CART**, centred task arithmetic with low-rank parts ("Revisiting Weight Averaging
for Model Merging", arXiv 2412.12153): the task vectors centred on their mean τ̄ = (1/T)·Σ_i Δ_i,
each centred part cut to its top k = max(1, ⌊ρ·min(m, n)⌋) singular directions (``--rank-ratio``
ρ), added back to the mean with ``--lambda``:

    W = W_base + τ̄ + λ·Σ_i [Δ_i − τ̄]_k

Defaults ρ = 0.12 and λ = 2.0, the reference code's configuration for its smallest task set
(8 tasks; 14 and 20 tasks use 0.16/1.5 and 0.32/1.9): sweep λ for a given set of tasks.

Other tensors (norms, biases, 1×N, matrices under ``--min-numel``): STAR's average times α, CART's
mean (its centred parts sum to zero there), as both papers leave them. Vocabulary matrices are
matrices like any other (``--exclude`` them to keep the first fine-tune's values).

Where the formulas are silent or degenerate (documented in docs/merge-methods.md and tested):

- singular values at the route's floor (σ² ≤ 4·min(m, n)·ε·σ_max², as in every spectral
  merge here) are zeros: a zero task vector contributes nothing (the reference code divides 0 by
  0), and STAR's sums run over the non-zero values;
- a cut between singular values the output dtype cannot tell apart would make the result
  depend on rounding (which of two equal directions is kept): the cut is extended over every
  singular value within ``ε·σ_max/u`` of the last one kept (u the output's unit roundoff), so
  the kept subspace is determined to the output's resolution; the record's ``error_bound``
  (ε·σ_max over the gap at the cut) says how well;
- CART with one fine-tune, or identical ones: the centred parts are zero and W = W_base + Δ.

Computed per matrix from float64 SVDs of the whole tall task vectors (``X_i``, N × M with
M = min(m, n)): working set ≈ (2T + 6)·8·N·M bytes (3 fine-tunes of a 4864 × 896 matrix, about
420 MB), checked against the machine's memory before anything is written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from dghard_cli.engine.ops import JobInputs
from dghard_cli.engine.plan import TensorJob
from dghard_cli.engine.working_memory import check_dense_svd
from dghard_cli.errors import InputError
from dghard_cli.methods.declare import finite
from dghard_cli.methods.merge_ops import ElementwiseMergeOp, TaskArithmeticKernel
from dghard_cli.methods.registry import NUMBER, BuildContext, MergeMethod, Param
from dghard_cli.methods.subspace import (
    ALPHA_SWEEP_RANGE,
    NonFiniteInput,
    TallBlocks,
    kept_nonfinite,
    matrix_rule,
    tolerance,
)
from dghard_cli.methods.subspace_svd import ROUTE, SvdResult, svd64
from dghard_cli.spectral.routes import GRAM_FLOOR

EPS64 = 2.0**-52
STAR_ETA = 40.0
CART_RANK_RATIO = 0.12
CART_LAMBDA = 2.0

# -- pure linear algebra --------------------------------------------------------------------------


def numerical_rank(sig: np.ndarray, small: int, reference: float | None = None) -> int:
    """Singular values above the route's floor (σ² > 4·M·ε·σ_ref², σ_ref the matrix's own σ_max,
    or ``reference`` for one computed as a difference: its rounding scales with what it came from)."""
    top = float(sig[0]) if reference is None and sig.size else float(reference or 0.0)
    if not sig.size or not top > 0:
        return 0
    return int(np.count_nonzero(sig**2 > GRAM_FLOOR * small * EPS64 * top**2))


def cut_with_ties(sig: np.ndarray, r: int, rank: int, unit: float) -> int:
    """``r`` extended over the singular values within ``ε·σ_max/unit`` of ``sig[r−1]`` (values
    the output dtype cannot tell apart from the last one kept), at most ``rank``."""
    if r <= 0:
        return 0
    delta = EPS64 * float(sig[0]) / unit
    while r < rank and sig[r] >= sig[r - 1] - delta:
        r += 1
    return r


def gap_kappa(sig: np.ndarray, r: int, rank: int) -> float:
    """``σ_max`` over the gap at the cut (1 where nothing is cut within the numerical rank)."""
    if r <= 0 or r >= rank:
        return 1.0
    return float(sig[0]) / float(sig[r - 1] - sig[r])


def truncate(
    x: torch.Tensor, r_of: Callable[[np.ndarray, int], int], unit: float, reference: float | None = None
) -> tuple[torch.Tensor, np.ndarray, int, float]:
    """The SVD of ``x`` cut at ``r_of(σ over the numerical rank, rank)`` (ties extended): the
    product ``U_r·diag(σ_r)·V_rᵀ``, all non-zero σ, the r used and σ_max/gap (``reference``: see
    :func:`numerical_rank`)."""
    u, s, vh = svd64(x)
    sig = s.cpu().numpy()
    rank = numerical_rank(sig, x.shape[1], reference)
    sig = sig[:rank]
    r = cut_with_ties(sig, min(r_of(sig, rank), rank), rank, unit) if rank else 0
    part = (u[:, :r] * s[:r]) @ vh[:r]
    return part, sig, r, gap_kappa(sig, r, rank)


def star_rank(eta: float) -> Callable[[np.ndarray, int], int]:
    """The smallest r whose σ's reach η % of their sum (at least 1)."""

    def r_of(sig: np.ndarray, rank: int) -> int:
        c = np.cumsum(sig)
        return max(1, min(rank, int(np.searchsorted(c, eta / 100.0 * c[-1], side="left")) + 1))

    return r_of


def star(xs: Sequence[torch.Tensor], eta: float, alpha: float, unit: float) -> SvdResult:
    """STAR's merged update of the tall task vectors ``xs``."""
    out = torch.zeros_like(xs[0])
    ranks, kappas = [], [1.0]
    for x in xs:
        part, sig, r, kappa = truncate(x, star_rank(eta), unit)
        if r:
            out.add_(part, alpha=float(sig.sum() / sig[:r].sum()))
        ranks.append(r)
        kappas.append(kappa)
    out.mul_(alpha / len(xs))
    return SvdResult(out, sum(ranks), max(kappas), {"task_ranks": ranks})


def cart_k(small: int, ratio: float) -> int:
    return max(1, int(ratio * small))


def cart(xs: Sequence[torch.Tensor], ratio: float, lam: float, unit: float) -> SvdResult:
    """CART's merged update of the tall task vectors ``xs``."""
    mean = xs[0].clone()
    for x in xs[1:]:
        mean.add_(x)
    mean.div_(len(xs))
    k = cart_k(xs[0].shape[1], ratio)
    out = mean.clone()
    ranks, kappas = [], [1.0]
    for x in xs:
        # the centred part is a difference: its rounding scales with the task vector (‖X_i‖_F ≥ σ_max)
        ref = float(torch.linalg.vector_norm(x))
        part, _, r, kappa = truncate(x - mean, lambda sig, rank: k, unit, reference=ref)
        if r:
            out.add_(part, alpha=lam)
        ranks.append(r)
        kappas.append(kappa)
    return SvdResult(out, sum(ranks), max(kappas), {"rank_k": k, "task_ranks": ranks})


# -- streaming ------------------------------------------------------------------------------------


class LowRankMergeOp:
    """STAR or CART on every eligible matrix (``merge(xs, unit)`` of the whole tall task
    vectors), ``scale``·the average of the deltas elsewhere."""

    def __init__(
        self,
        name: str,
        merge: Callable[[list[torch.Tensor], float], SvdResult],
        scale: float,
        device: torch.device,
        is_matrix: Callable[[TensorJob], bool],
        block_bytes: int,
    ) -> None:
        self.name, self.merge, self.device = name, merge, device
        self.is_matrix, self.block_bytes = is_matrix, block_bytes
        self.average = ElementwiseMergeOp(
            lambda job: TaskArithmeticKernel([scale / len(job.fts)] * len(job.fts), 1.0), device, block_bytes
        )

    def __call__(self, job: TensorJob, src: JobInputs, rec: dict) -> Iterator[torch.Tensor]:
        if not self.is_matrix(job):
            rec["merge_rule"] = "average"
            yield from self.average(job, src, rec)
            return
        blocks = TallBlocks(job, src, self.device, self.block_bytes)
        # the working set was checked for every matrix before anything was written (merging.py)
        xs = blocks.whole()
        if not all(bool(torch.isfinite(x).all()) for x in xs):
            if not src.allow_nonfinite:
                raise NonFiniteInput.of(job)
            yield from kept_nonfinite(job, src, rec)
            return
        written = job.final_dtype or job.out_dtype
        res = self.merge(xs, tolerance(written))
        del xs
        rec.update(
            {
                "merge_rule": self.name,
                "route": ROUTE,
                "kept_directions": res.rank,  # Σ_i r_i (no ``rank``: the merged update's is not computed)
                "error_bound": float(f"{EPS64 * res.kappa:.4g}"),
                **res.stats,
            }
        )
        rows = iter(torch.split(res.delta, blocks.step))
        yield from blocks.output(lambda _: next(rows), None)


# -- declared for dghard merge (see dghard_cli.methods.registry) ------------------------------------


def _check_eta(value: Any, method: MergeMethod, n_fts: int) -> float:
    v = finite("eta", value)
    if not 0.0 < v <= 100.0:
        raise InputError(
            f"--eta must be in (0, 100] (a percentage of each task vector's nuclear norm), got {v}"
        )
    return v


def _check_ratio(value: Any, method: MergeMethod, n_fts: int) -> float:
    v = finite("rank-ratio", value)
    if not 0.0 < v <= 1.0:
        raise InputError(f"--rank-ratio must be in (0, 1] (a share of min(m, n)), got {v}")
    return v


def _star_op(p: dict, ctx: BuildContext) -> LowRankMergeOp:
    eta, alpha = p["eta"], p["alpha"]
    return LowRankMergeOp(
        "star",
        lambda xs, unit: star(xs, eta, alpha, unit),
        alpha,
        ctx.device,
        matrix_rule(ctx.options.policy),
        ctx.block_bytes,
    )


def _cart_op(p: dict, ctx: BuildContext) -> LowRankMergeOp:
    ratio, lam = p["rank_ratio"], p["lambda"]
    return LowRankMergeOp(
        "cart",
        lambda xs, unit: cart(xs, ratio, lam, unit),
        1.0,
        ctx.device,
        matrix_rule(ctx.options.policy),
        ctx.block_bytes,
    )


def _check_plan(method: str) -> Callable[[dict, Any, int, Any, Any], None]:
    def check(p: dict, jobs: Any, n_fts: int, policy: Any, device: Any) -> None:
        """Their float64 SVDs of whole matrices: refused before anything is written."""
        check_dense_svd(
            jobs, n_fts=n_fts, is_matrix=matrix_rule(policy), what=f"--method {method}", device=device
        )

    return check


def _summary(rule: str) -> Callable[[list[dict], dict], dict]:
    def summary(rows: list[dict], p: dict) -> dict:
        done = [r for r in rows if r.get("merge_rule") == rule]
        out: dict = {"low_rank_matrices": len(done), "averaged_tensors": len(rows) - len(done)}
        if done:
            kept = sorted(r["kept_directions"] for r in done)
            out["median_kept_directions"] = kept[len(kept) // 2]
            out["error_bound_max"] = max(r["error_bound"] for r in done)
        return out

    return summary


PARAMS = (
    Param(
        "eta",
        NUMBER,
        "star: % of each task vector's nuclear norm kept (default 40).",
        default=STAR_ETA,
        check=_check_eta,
        sweep_range=(5.0, 100.0),
    ),
    Param(
        "rank_ratio",
        NUMBER,
        "cart: rank kept of each centred task vector, a share of min(m, n) (default 0.12).",
        default=CART_RANK_RATIO,
        check=_check_ratio,
        flag="--rank-ratio",
        sweep_range=(0.01, 1.0),
    ),
)
MERGE_METHODS = (
    MergeMethod(
        "star",
        ("alpha", "eta"),
        _star_op,
        summary=_summary("star"),
        check_plan=_check_plan("star"),
        defaults={"alpha": 1.0},
        sweep_axes=("alpha", "eta"),
        sweep_fixed=("eta",),
        sweep_ranges={"alpha": ALPHA_SWEEP_RANGE},
        core_space="lossless",
    ),
    MergeMethod(
        "cart",
        ("lambda", "rank_ratio"),
        _cart_op,
        summary=_summary("cart"),
        check_plan=_check_plan("cart"),
        defaults={"lambda": CART_LAMBDA},
        sweep_axes=("lambda", "rank_ratio"),
        sweep_fixed=("rank_ratio",),
        sweep_ranges={"lambda": (0.0, 4.0)},
        core_space="cores",  # its low rank is a share of the matrix's rank
    ),
)
