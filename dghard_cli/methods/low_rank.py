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

Computed per matrix on the **streaming Gram route** of the subspace merges (:mod:`.subspace`):
each task vector's (CART: each centred part's) float64 Gram matrix ``XᵀX`` (M × M, M = min(m, n))
is accumulated over row blocks in one pass, its eigendecomposition gives the singular values and
the kept right singular vectors V_r, and the output pass writes each row block of
``Σ_i c_i·X_i·V_r·V_rᵀ`` (the truncation ``U_r·diag(σ_r)·V_rᵀ = X·V_r·V_rᵀ``). No N × M matrix
is held: the working set is T Gram matrices and one set of row blocks (3 fine-tunes of the
151936 × 896 embedding of a 0.5B model: about 20 MB of Gram matrices, against 8–10 GB for the
dense SVDs). It grows with M² all the same (a header may declare a 60000 × 60000 matrix: 28.8 GB
a Gram matrix), so :func:`plan_check` refuses, before anything is written, a matrix whose
:func:`gram_route_bytes` exceed the process's memory budget. The Gram route's error bound
(:func:`gram_cut`: the kept subspace, STAR's rescaling, components at the rank's floor) is each
record's ``error_bound``. A matrix whose bound exceeds the output dtype's resolution (float32's
at the finest), or whose tie extension or STAR
η-crossing lies within the route's error of its threshold, is computed again by the **accurate
route**: float64
SVDs of the whole tall task vectors (``X_i``, N × M), working set ≈ (2T + 6)·8·N·M bytes (3
fine-tunes of a 4864 × 896 matrix, about 420 MB), checked against the memory budget before
that matrix is computed; its record says ``route: "svd-float64"`` and keeps the Gram route's bound
as ``gram_error_bound``. Both routes keep the same numerical rank and cut, so they differ only in
rounding, below the output's resolution.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
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
    check_accurate_route,
    kept_nonfinite,
    matrix_rule,
    tolerance,
)
from dghard_cli.methods.subspace_svd import ROUTE as SVD_ROUTE
from dghard_cli.methods.subspace_svd import SvdResult, svd64
from dghard_cli.spectral.routes import GRAM_FLOOR, gram_add_, gram_growth
from dghard_cli.spectral.spectrum import ROUTE as GRAM_ROUTE
from dghard_cli.spectral.spectrum import Spectrum

EPS64 = 2.0**-52
STAR_ETA = 40.0
CART_RANK_RATIO = 0.12
CART_LAMBDA = 2.0

# -- pure linear algebra --------------------------------------------------------------------------


def numerical_rank(sig: np.ndarray, small: int, reference: float | None = None) -> int:
    """Singular values above the route's floor (σ² > 4·M·ε·σ_ref², σ_ref the larger of the
    matrix's own σ_max and ``reference``, for one computed as a difference: its rounding scales
    with what it came from)."""
    top = max(float(sig[0]) if sig.size else 0.0, float(reference or 0.0))
    if not sig.size or not top > 0:
        return 0
    return int(np.count_nonzero(sig**2 > GRAM_FLOOR * small * EPS64 * top**2))


def report_bound(b: float) -> float | None:
    """An error bound as the report writes it: 4 significant digits, None where infinite (a
    decision within the route's rounding)."""
    return float(f"{b:.4g}") if math.isfinite(b) else None


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
    mean_norm = float(torch.linalg.vector_norm(mean))
    for x in xs:
        # the centred part is a difference: its rounding scales with the task vector and the mean
        # it came from (‖·‖_F ≥ σ_max); a zero task vector's part, −τ̄, is as real as any other
        ref = max(float(torch.linalg.vector_norm(x)), mean_norm)
        part, _, r, kappa = truncate(x - mean, lambda sig, rank: k, unit, reference=ref)
        if r:
            out.add_(part, alpha=lam)
        ranks.append(r)
        kappas.append(kappa)
    return SvdResult(out, sum(ranks), max(kappas), {"rank_k": k, "task_ranks": ranks})


# -- the Gram route ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class GramCut:
    """One task vector's (or centred part's) truncation on the Gram route: ``X·V·diag(1)·Vᵀ``
    scaled by ``scale``, and how exactly the Gram route decided it."""

    v: torch.Tensor  # M × r float64, the kept right singular vectors
    scale: float
    sigma: np.ndarray  # the non-zero singular values
    r: int
    amplification: float  # the error bound over ε; inf: a decision is within the route's error


def gram_spectrum(
    g: torch.Tensor, shape: tuple[int, int], reference: float | None = None
) -> tuple[Spectrum, np.ndarray, float]:
    """The spectrum of one Gram matrix, its raw eigenvalues (descending) and λ_ref, the larger of
    its λ_max and ``reference²`` (see :func:`numerical_rank`); σ² at or below the floor
    ``4·M·ε·λ_ref`` are zeros, as on every Gram route."""
    g = 0.5 * (g + g.T)
    lam = torch.linalg.eigvalsh(g).flip(0).cpu().numpy().astype(np.float64)
    lam_ref = max(float(lam[0]) if lam.size else 0.0, float(reference or 0.0) ** 2, 0.0)
    sig = np.sqrt(np.where(lam > GRAM_FLOOR * g.shape[0] * EPS64 * lam_ref, lam, 0.0))
    return Spectrum(shape=shape, sigma=sig, fro2=float(torch.trace(g)), gram=g), lam, lam_ref


def gram_cut(
    spec: Spectrum,
    lam_raw: np.ndarray,
    lam_ref: float,
    r_of: Callable[[np.ndarray, int], int],
    unit: float,
    rescale: bool = False,
    eta: float | None = None,
) -> GramCut:
    """:func:`truncate`'s cut from a Gram matrix's spectrum (:func:`gram_spectrum`): the same
    numerical rank, the same cut with ties extended; ``rescale``: STAR's factor ``Σσ/Σ_{j≤r}σ``;
    ``eta``: STAR's cut is at η % of the sum (checked against the sums' error).

    The Gram matrix of N rows is known to E ≈ √N·ε·λ_ref (:func:`gram_growth`), so an eigenvalue
    to E, a σ to E/(2σ), and the kept subspace mixes with a dropped direction by E/(λ_r − λ_{r+1});
    in X·V_r·V_rᵀ that moves the result by √N·ε·σ_ref·σ_r/(λ_r − λ_{r+1}) relative to σ_ref (rotations within the kept
    subspace cancel). The amplification (the error bound over ε) is the largest of that and, for
    STAR, the sums' relative error; plus, for each eigenvalue within ``(M + √N)·ε·λ_ref`` of the floor
    (decided either way by rounding), its σ relative to σ_ref. It is inf where the tie extension
    or STAR's η-crossing lies within the route's error of its threshold."""
    sig_all = spec.sigma
    small = spec.small
    dev = spec.gram.device if spec.gram is not None else None
    floor = GRAM_FLOOR * small * EPS64 * lam_ref
    rank = int(np.count_nonzero(sig_all > 0))
    sig = sig_all[:rank]
    grow = gram_growth(max(spec.shape))
    err_lam = grow * EPS64 * lam_ref  # an eigenvalue's error on this route
    # components at the floor: included or not by rounding; each moves the result by its σ
    # (within the eigensolver's M·ε·λ_ref plus the Gram's √N·ε·λ_ref of it)
    n_edge = int(np.count_nonzero(np.abs(lam_raw - floor) <= (small + grow) * EPS64 * lam_ref))
    edge = n_edge * math.sqrt(floor / lam_ref) if lam_ref > 0 else 0.0
    if not rank:
        empty = torch.zeros((small, 0), dtype=torch.float64, device=dev)
        return GramCut(empty, 0.0, sig, 0, max(1.0, edge / EPS64))
    r0 = min(r_of(sig, rank), rank)
    r = cut_with_ties(sig, r0, rank, unit)
    err_sig = err_lam / (2.0 * sig)  # each σ's error
    amp = 1.0
    # the tie extension compared σ[j] with σ[j−1] − ε·σ_max/unit for j = r0 … r (below the rank)
    delta = EPS64 * float(sig[0]) / unit
    for j in range(max(r0, 1), min(r, rank - 1) + 1):
        if abs(float(sig[j - 1] - sig[j]) - delta) <= err_sig[j - 1] + err_sig[j]:
            amp = math.inf
    lam = sig**2
    gap = lam[r - 1] - (lam[r] if r < rank else 0.0)
    amp = max(amp, grow * math.sqrt(lam_ref) * float(sig[r - 1]) / gap if gap > 0 else math.inf)
    scale = 1.0
    if rescale:
        total, part = float(sig.sum()), float(sig[:r].sum())
        e_total = float(err_sig.sum()) + edge * math.sqrt(lam_ref)
        e_part = float(err_sig[:r].sum())
        amp = max(amp, (e_total / total + e_part / part) / EPS64)
        scale = total / part
        if eta is not None:  # the η-crossing: the cumulative sums on either side of the cut
            c = np.cumsum(sig)
            target = eta / 100.0 * c[-1]
            err = e_total * (1.0 + eta / 100.0)
            first = r_of(sig, rank)
            # the last partial sum is the total itself, which η ≤ 100 % never exceeds
            above = first < rank and c[first - 1] - target <= err
            if above or (first >= 2 and target - c[first - 2] <= err):
                amp = math.inf
    amp += edge * max(1.0, scale) / EPS64
    v = spec.vectors_for(np.arange(r))
    return GramCut(v, scale, sig, r, amp)


def star_gram(
    gs: Sequence[torch.Tensor], shape: tuple[int, int], eta: float, alpha: float, unit: float
) -> tuple[list[GramCut], float]:
    """STAR's cuts of every task vector from its Gram matrix, and the update's factor α/T."""
    cuts = []
    for g in gs:
        spec, lam, lam_ref = gram_spectrum(g, shape)
        cuts.append(gram_cut(spec, lam, lam_ref, star_rank(eta), unit, rescale=True, eta=eta))
    return cuts, alpha / len(gs)


def cart_gram(
    gs: Sequence[torch.Tensor], norms: Sequence[float], shape: tuple[int, int], ratio: float, unit: float
) -> tuple[list[GramCut], int]:
    """CART's cuts of every centred part from its Gram matrix (``norms``: max(‖X_i‖_F, ‖τ̄‖_F),
    the reference of each part's numerical rank as in :func:`cart`), and k."""
    k = cart_k(min(shape), ratio)
    cuts = []
    for g, ref in zip(gs, norms, strict=True):
        spec, lam, lam_ref = gram_spectrum(g, shape, reference=ref)
        cuts.append(gram_cut(spec, lam, lam_ref, lambda sig, rank: k, unit))
    return cuts, k


def project(x: torch.Tensor, cut: GramCut) -> torch.Tensor:
    """``scale·X·V·Vᵀ`` of one row block (the cut's truncation of those rows)."""
    return (x @ cut.v) @ (cut.v.T * cut.scale)


def _mean(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    m = xs[0].clone()
    for x in xs[1:]:
        m.add_(x)
    return m.div_(len(xs))


def _finite_grams(job: TensorJob, gs: Sequence[torch.Tensor]) -> None:
    for g in gs:
        if not bool(torch.isfinite(g).all()):
            raise NonFiniteInput.of(job)


@dataclass(frozen=True)
class GramPlan:
    """A method's plan for one matrix on the Gram route."""

    update: Callable[[list[torch.Tensor]], torch.Tensor]  # the merged update's rows, per block
    kept: int  # Σ_i r_i
    amplification: float
    stats: dict


def star_plan(blocks: TallBlocks, eta: float, alpha: float, unit: float) -> GramPlan:
    gs, _ = blocks.grams(each=True, total=False)
    cuts, factor = star_gram(gs, blocks.shape, eta, alpha, unit)
    del gs

    def update(xs: list[torch.Tensor]) -> torch.Tensor:
        out = torch.zeros_like(xs[0])
        for x, cut in zip(xs, cuts, strict=True):
            if cut.r:
                out.add_(project(x, cut))
        return out.mul_(factor)

    ranks = [c.r for c in cuts]
    return GramPlan(update, sum(ranks), max(c.amplification for c in cuts), {"task_ranks": ranks})


def cart_plan(blocks: TallBlocks, ratio: float, lam: float, unit: float) -> GramPlan:
    m = blocks.small
    gs = [torch.zeros((m, m), dtype=torch.float64, device=blocks.device) for _ in range(blocks.n)]
    sumsq = [0.0] * (blocks.n + 1)  # ‖X_i‖_F², then ‖τ̄‖_F²
    for _, xs in blocks:
        mean = _mean(xs)
        for i, x in enumerate(xs):
            sumsq[i] += float(torch.linalg.vector_norm(x) ** 2)
            gram_add_(gs[i], x - mean)
        sumsq[-1] += float(torch.linalg.vector_norm(mean) ** 2)
    _finite_grams(blocks.job, gs)
    if not all(math.isfinite(v) for v in sumsq):
        raise NonFiniteInput.of(blocks.job)
    refs = [math.sqrt(max(v, sumsq[-1])) for v in sumsq[:-1]]
    cuts, k = cart_gram(gs, refs, blocks.shape, ratio, unit)
    del gs

    def update(xs: list[torch.Tensor]) -> torch.Tensor:
        mean = _mean(xs)
        out = mean.clone()
        for x, cut in zip(xs, cuts, strict=True):
            if cut.r:
                out.add_(project(x - mean, cut), alpha=lam)
        return out

    ranks = [c.r for c in cuts]
    amp = max(c.amplification for c in cuts)
    return GramPlan(update, sum(ranks), amp, {"rank_k": k, "task_ranks": ranks})


def gram_route_bytes(rows: int, cols: int, n_fts: int) -> int:
    """The Gram route's float64 working set for one m × n matrix (M = min(m, n)): the T Gram
    matrices, one eigendecomposition's symmetrised copy, eigenvectors and LAPACK workspace (about
    5 M × M matrices; measured 4.5–4.9 for M = 1500), and the T kept bases V_r (up to M × M
    each); a wide matrix's inputs and output whole (4 bytes a value counted). The row blocks
    (``block_bytes``) come on top."""
    small = min(rows, cols)
    whole = (n_fts + 2) * 4 * rows * cols if rows < cols else 0
    return (2 * n_fts + 5) * 8 * small * small + whole


def plan_check(name: str, parts: str) -> Callable[[dict, Sequence[TensorJob], int, Any, Any], None]:
    """``--method name``'s check before anything is written: every matrix's Gram route (the Gram
    matrices of ``parts``) fits in the memory this process may use. The accurate route is
    checked when a matrix needs it (most never do)."""

    def check(p: dict, jobs: Sequence[TensorJob], n_fts: int, policy: Any, device: Any) -> None:
        check_dense_svd(
            jobs,
            n_fts=n_fts,
            is_matrix=matrix_rule(policy),
            what=f"--method {name}",
            device=device,
            bytes_of=gram_route_bytes,
            work=f"float64 Gram matrices of {parts}",
        )

    return check


# -- streaming ------------------------------------------------------------------------------------


class LowRankMergeOp:
    """STAR or CART on every eligible matrix, ``scale``·the average of the deltas elsewhere: the
    Gram route (``plan(blocks, unit)``), else the accurate route (``merge(xs, unit)`` of the whole
    tall task vectors) where the Gram route's bound exceeds the output's resolution."""

    def __init__(
        self,
        name: str,
        plan: Callable[[TallBlocks, float], GramPlan],
        merge: Callable[[list[torch.Tensor], float], SvdResult],
        scale: float,
        device: torch.device,
        is_matrix: Callable[[TensorJob], bool],
        block_bytes: int,
    ) -> None:
        self.name, self.plan, self.merge, self.device = name, plan, merge, device
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
        written = job.final_dtype or job.out_dtype
        tol = tolerance(written)
        try:
            plan = self.plan(blocks, tol)
        except NonFiniteInput:
            if not src.allow_nonfinite:
                raise
            yield from kept_nonfinite(job, src, rec)
            return
        bound = EPS64 * plan.amplification
        rec.update(
            {
                "merge_rule": self.name,
                "route": GRAM_ROUTE,
                "kept_directions": plan.kept,  # Σ_i r_i (no ``rank``: the merged update's is not computed)
                "error_bound": float(f"{bound:.4g}"),
                **plan.stats,
            }
        )
        if bound <= tol:
            yield from blocks.output(plan.update, None)
            return
        # the Gram route does not resolve this matrix to the written dtype: the accurate route
        check_accurate_route(
            blocks,
            self.device,
            f"--method {self.name}'s float64 Gram route does not resolve this matrix to the {written} "
            f"output's resolution {tol:.1e} (error bound {bound:.1e})",
            written,
            bound,
        )
        res = self.merge(blocks.whole(), tol)
        rec.update(
            {
                "route": SVD_ROUTE,
                "kept_directions": res.rank,
                "error_bound": float(f"{EPS64 * res.kappa:.4g}"),
                "gram_error_bound": report_bound(bound),
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
        lambda blocks, unit: star_plan(blocks, eta, alpha, unit),
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
        lambda blocks, unit: cart_plan(blocks, ratio, lam, unit),
        lambda xs, unit: cart(xs, ratio, lam, unit),
        1.0,
        ctx.device,
        matrix_rule(ctx.options.policy),
        ctx.block_bytes,
    )


def _summary(rule: str) -> Callable[[list[dict], dict], dict]:
    def summary(rows: list[dict], p: dict) -> dict:
        done = [r for r in rows if r.get("merge_rule") == rule]
        out: dict = {"low_rank_matrices": len(done), "averaged_tensors": len(rows) - len(done)}
        if done:
            kept = sorted(r["kept_directions"] for r in done)
            out["median_kept_directions"] = kept[len(kept) // 2]
            out["error_bound_max"] = max(r["error_bound"] for r in done)
            accurate = sum(r["route"] == SVD_ROUTE for r in done)
            if accurate:  # matrices the Gram route did not resolve to the output dtype
                out["accurate_route_matrices"] = accurate
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
        check_plan=plan_check("star", "the task vectors"),
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
        check_plan=plan_check("cart", "the centred task vectors"),
        defaults={"lambda": CART_LAMBDA},
        sweep_axes=("lambda", "rank_ratio"),
        sweep_fixed=("rank_ratio",),
        sweep_ranges={"lambda": (0.0, 4.0)},
        core_space="cores",  # its low rank is a share of the matrix's rank
    ),
)
