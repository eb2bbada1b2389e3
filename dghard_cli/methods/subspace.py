"""The streaming core of the subspace merges: TSV-M (:mod:`.tsv`), Iso-C and Iso-CTS (:mod:`.iso`).

Each of them builds, per weight matrix, a merged update of one form

    Δ* = α · polar(U_cat) · D · polar(V_cat)ᵀ

from singular triplets of the task vectors Δ_i = W_i − W_base (or of their sum): ``U_cat`` and
``V_cat`` are concatenated singular vectors, ``D`` their singular values (TSV) or one flat value
(Iso), and ``polar(A) = A·(AᵀA)^{+1/2}`` is the nearest matrix with orthonormal columns (the
polar factor P·Qᵀ of the SVD A = P·S·Qᵀ; on a rank-deficient A the partial isometry over its
non-zero singular values, so exactly repeated directions do not invent new ones).

Everything is computed in the *tall form* of the matrix (``X = Δ`` when m ≥ n, else ``Δᵀ``;
``N × M``, ``M = min(m, n)``; see :mod:`dghard_cli.spectral.spectrum`), in float64, from the
route the engine already has: float64 Gram matrices ``XᵀX`` accumulated over row blocks and their
eigendecomposition (right singular vectors and singular values). Left singular vectors are never
stored: each is a linear image of the rows, ``u = X·v/σ``, so the concatenated left basis is
produced block by block (``Z_b``, ``N_b × R``), its Gram ``ZᵀZ`` (R × R) is accumulated in one
pass, and the output pass writes ``W_base + Z_b·K`` with the small ``K = α·(ZᵀZ)^{+1/2}·D·
(V_catᵀV_cat)^{+1/2}·V_catᵀ`` (R × M). Memory per matrix is a few ``M × M`` float64 matrices
plus one set of row blocks (the methods' docstrings give each one's working set); a wide matrix
(m < n) is read whole, as in every spectral pass.

Accuracy: the Gram route resolves a direction of singular value σ to about ``ε·(σ_max/σ)²``
relative (ε = 2⁻⁵²; measured errors sit ~50× below). The orthogonalisation and the flat
spectrum divide by such σ's, so every matrix records ``error_bound = ε·max(λ_max/λ_min)`` over
the Gram matrices whose inverse square root it takes; a matrix whose bound exceeds the output
dtype's resolution (unit roundoff, float32's at the finest) is computed again by the accurate
route (:mod:`.subspace_svd`: float64 SVDs of the matrices themselves, error ``ε·σ_max/σ``, which
the numerical-rank floor keeps below float32's resolution) and its record says so — never
refused for accuracy, never written approximately. Singular values at the route's floor (below
``sqrt(4·M·ε)·σ_max``) are exact zeros: the numerical rank; for a LoRA adapter read as a
fine-tune (BASE + B·A computed in float32) so are those at its rounding level
(:meth:`TallBlocks.noise`).

Tensors that are not eligible matrices (1-D norms and biases, 1×N tensors, matrices under
``--min-numel``) are averaged, as in both papers: ``W_base + α·mean_i(Δ_i)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dghard_cli.engine.ops import JobInputs, all_finite, cast_out, passthrough, strength_advice
from dghard_cli.engine.plan import TensorJob, matrix_eligibility
from dghard_cli.engine.scratch import Scratch, current
from dghard_cli.engine.working_memory import over_budget
from dghard_cli.errors import KEEP_NONFINITE, InputError
from dghard_cli.io.safetensors_format import UNIT_ROUNDOFF, torch_dtype
from dghard_cli.lora.view import ComputedTensorInfo
from dghard_cli.methods.merge_ops import ElementwiseMergeOp, TaskArithmeticKernel
from dghard_cli.methods.subspace_svd import ROUTE as SVD_ROUTE
from dghard_cli.methods.subspace_svd import SvdResult, svd_route_bytes
from dghard_cli.spectral.routes import GRAM_FLOOR, block_rows, gram_add_, gram_growth, spectrum_from_gram
from dghard_cli.spectral.spectrum import ROUNDING_STD_FACTOR, ROUTE, Spectrum

EPS64 = 2.0**-52  # float64 machine epsilon (np.finfo(np.float64).eps)
#: The finest resolution an output is checked at (float64 outputs: float32's).
FINEST = 2.0**-24
#: Safety factor over the predicted largest singular value of a computed adapter's rounding.
NOISE_EDGE = 4.0
#: The default sweep range of the subspace merges' α (a scale of the merged update, >= 0): both
#: papers validate it around 1 (the knowledge merge benchmark's best is 1.4), so up to 3.
ALPHA_SWEEP_RANGE = (0.0, 3.0)


# -- pure linear algebra --------------------------------------------------------------------------


@dataclass(frozen=True)
class InvSqrt:
    """``(AᵀA)^{+1/2}`` of a Gram matrix: the pseudo-inverse square root over its numerical rank."""

    matrix: torch.Tensor  # R × R float64, symmetric
    rank: int
    amplification: float  # λ_max / λ_min over the kept eigenvalues (1 when none)


def inv_sqrt_psd(g: torch.Tensor) -> InvSqrt:
    """``Q_k·diag(λ_k^{-1/2})·Q_kᵀ`` over the eigenvalues above the Gram route's floor
    (``GRAM_FLOOR·R·ε·λ_max``, as :func:`~dghard_cli.spectral.routes.spectrum_from_gram`)."""
    r = g.shape[0]
    if r == 0:
        return InvSqrt(g.new_zeros((0, 0)), 0, 1.0)
    lam, q = torch.linalg.eigh(0.5 * (g + g.T))
    lam_max = float(lam[-1]) if lam.numel() else 0.0
    if not lam_max > 0.0:
        return InvSqrt(torch.zeros_like(g), 0, 1.0)
    keep = lam > GRAM_FLOOR * r * EPS64 * lam_max
    lk, qk = lam[keep], q[:, keep]
    mat = (qk * lk.rsqrt()) @ qk.T
    return InvSqrt(mat, int(keep.sum()), lam_max / float(lk.min()))


def top_triplets(
    spectrum: Spectrum, k: int, reference: float | None = None, noise: float = 0.0
) -> tuple[torch.Tensor, np.ndarray, float]:
    """The top ``min(k, numerical rank)`` right singular vectors (M × k', float64), their singular
    values, and the amplification ``λ_ref/σ_k'²`` a division by them costs (1 when none).

    ``reference``: the largest eigenvalue of the Gram matrix the spectrum's rounding scales with
    (default its own, σ_1²) — a Gram matrix formed as a difference (Iso-CTS's projected task
    Gram matrices) is only as accurate as the one it was subtracted from; components at or below
    the route's floor relative to it are zeros. ``noise``: singular values at or below it are
    zeros too (the rounding of a computed adapter input, :meth:`TallBlocks.noise`)."""
    sigma = spectrum.sigma
    lam_ref = float(sigma[0] ** 2) if reference is None and sigma.size else float(reference or 0.0)
    floor = GRAM_FLOOR * spectrum.small * EPS64 * lam_ref
    rank = int(np.count_nonzero((sigma > 0) & (sigma**2 > floor) & (sigma > noise)))
    k = max(0, min(k, rank))
    if k == 0:
        dev = spectrum.gram.device if spectrum.gram is not None else torch.device("cpu")
        return torch.zeros((spectrum.small, 0), dtype=torch.float64, device=dev), np.zeros(0), 1.0
    sig = sigma[:k].copy()
    vecs = spectrum.vectors_for(np.arange(k))
    return vecs, sig, float(lam_ref / sig[-1] ** 2)


def polar_kernel(
    zz: InvSqrt, v_cat: torch.Tensor, d: torch.Tensor, alpha: float
) -> tuple[torch.Tensor, int, float]:
    """``K = α·(ZᵀZ)^{+1/2}·diag(d)·(V_catᵀV_cat)^{+1/2}·V_catᵀ`` (R × M): the output rows are
    ``Z_b·K`` = ``α·polar(U_cat)·diag(d)·polar(V_cat)ᵀ``; returns K, the result's rank and the
    amplification of V_cat's orthogonalisation."""
    vv = inv_sqrt_psd(v_cat.T @ v_cat)
    k = (zz.matrix * d) @ vv.matrix @ v_cat.T
    if alpha != 1.0:
        k.mul_(alpha)
    nonzero = int(torch.count_nonzero(d))
    return k, min(zz.rank, vv.rank, nonzero), vv.amplification


def coarser_output_hint(written: str, bound: float) -> str:
    """What to do when a route's error bound exceeds the written dtype's resolution: a coarser
    output dtype only where one exists whose resolution the bound meets (bf16 is the coarsest)."""
    if tolerance("BF16") > tolerance(written) and bound <= tolerance("BF16"):
        return "write a lower-precision output (--dtype bf16) or --exclude the tensor"
    return "--exclude the tensor (keeps the fine-tune's value) or merge it with another --method"


def tolerance(out_dtype: str) -> float:
    """The resolution a matrix's result is checked at: the output dtype's unit roundoff, float32's
    at the finest."""
    return max(UNIT_ROUNDOFF.get(out_dtype, FINEST), FINEST)


# -- streaming ------------------------------------------------------------------------------------


class NonFiniteInput(InputError):
    """BASE or a fine-tune holds NaN/Inf in a matrix (or its delta overflows)."""

    @classmethod
    def of(cls, job: TensorJob) -> NonFiniteInput:
        return cls(
            f"tensor {job.name!r}: BASE or fine-tune values are NaN/Inf (or overflow); fix the checkpoint",
            advice=KEEP_NONFINITE,
        )


def kept_nonfinite(job: TensorJob, src: JobInputs, rec: dict) -> Iterator[torch.Tensor]:
    """A matrix with NaN/Inf inputs under ``--allow-nonfinite``: the fine-tune's value, reported."""
    rec["action"], rec["reason"], rec["nonfinite"] = "kept-ft", "nonfinite", True
    return passthrough(job, src, rec)


class TallBlocks:
    """The tall-form blocks of one matrix, every pass the same: ``(base block, [X_i block])``.

    A tall matrix (m ≥ n) is read in row blocks (from disk when it was not prefetched); a wide
    one is read whole once per pass and split into column blocks (rows of its tall form). All
    blocks of one step together are about ``block_bytes`` of float64. ``row_form``: a wide matrix
    read in row blocks as if tall (``X = Δ``, its Gram matrices n × n, the larger side), for a
    method whose formula has the same value in either form and is cheaper there.
    """

    def __init__(
        self,
        job: TensorJob,
        src: JobInputs,
        device: torch.device,
        block_bytes: int,
        *,
        row_form: bool = False,
    ) -> None:
        self.job, self.src, self.device = job, src, device
        self.rows = job.shared_rows if job.shared_rows is not None else job.shape[0]
        self.cols = job.shape[1]
        self.tall = row_form or self.rows >= self.cols
        self.n = len(job.fts)
        self.shape = (self.rows, self.cols)
        #: the tall form's rows N and columns M (M is the Gram matrices' order)
        self.big, self.small = (self.rows, self.cols) if self.tall else (self.cols, self.rows)
        self.step = block_rows(self.small, max(1, block_bytes // (self.n + 2)))
        #: fine-tunes that are LoRA adapters, read as BASE + B·A computed in float32
        self.computed = [isinstance(info, ComputedTensorInfo) for info in job.fts]
        self._sumsq = [0.0] * self.n  # ‖W_i‖² of the computed ones (pass 1)

    def _to(self, t: torch.Tensor, slot: str, work: Scratch | None) -> torch.Tensor:
        """A float64 copy, contiguous (always a copy: blocks are modified in place, and a float64
        input's must stay as read); in ``work``'s buffer for ``slot`` when given."""
        if work is None:
            return t.to(device=self.device, dtype=torch.float64, copy=True)
        return work.take(slot, t.shape, torch.float64, self.device).copy_(t)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, list[torch.Tensor]]]:
        """``(base block, [X_i block])`` in order. On the CPU the blocks are the job's scratch
        buffers, overwritten by the next step: use them before asking for the next."""
        src, rows, cols = self.src, self.rows, self.cols
        work = current() if self.device.type == "cpu" else None
        if self.tall:
            for r0 in range(0, rows, self.step):
                r = (r0, min(r0 + self.step, rows))
                b = self._to(src.base(r), "tall.b", work)
                yield b, [self._to(src.ft(i, r), f"tall.x{i}", work).sub_(b) for i in range(self.n)]
            return
        base = src.base()[:rows]
        fts = [src.ft(i)[:rows] for i in range(self.n)]
        for c0 in range(0, cols, self.step):
            c = slice(c0, min(c0 + self.step, cols))
            b = self._to(base[:, c], "tall.b", work).T
            yield b, [self._to(f[:, c], f"tall.x{i}", work).T.sub_(b) for i, f in enumerate(fts)]

    def grams(self, *, each: bool, total: bool) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """``X_iᵀX_i`` of every fine-tune (``each``) and ``SᵀS`` of ``S = Σ_i X_i`` (``total``), one
        pass; NonFiniteInput when an input holds NaN/Inf."""
        m = self.small
        zeros = lambda: torch.zeros((m, m), dtype=torch.float64, device=self.device)  # noqa: E731
        gs = [zeros() for _ in range(self.n)] if each else []
        gt = zeros() if total else None
        sumsq = [torch.zeros((), dtype=torch.float64, device=self.device) for _ in range(self.n)]
        work = current() if self.device.type == "cpu" else None
        for b, xs in self:
            for g, x in zip(gs, xs, strict=False):
                gram_add_(g, x)
            if gt is not None:
                gram_add_(gt, _sum(xs, work))
            for i, x in enumerate(xs):
                if self.computed[i]:
                    sumsq[i] += torch.linalg.vector_norm(x + b) ** 2
        self._sumsq = [float(t) for t in sumsq]
        for g in [*gs, *([gt] if gt is not None else [])]:
            if not bool(torch.isfinite(g).all()):
                raise NonFiniteInput.of(self.job)
        return gs, gt

    def noise(self, which: Sequence[int] | None = None) -> float:
        """The largest singular value the float32 rounding of the computed adapter inputs among
        ``which`` (default all; their sum) can produce: ``NOISE_EDGE·0.4·2⁻²⁴·rms(W_i)·(√N + √M)``
        combined in quadrature; 0 for stored inputs (their deltas are exact, and both papers use
        every singular value of them). An adapter's update is exactly low-rank, so what lies at
        that level is the computation's rounding, not a direction (a flat spectrum or an
        orthogonalisation would blow it up to full strength)."""
        idx = range(self.n) if which is None else which
        edge = math.sqrt(self.big) + math.sqrt(self.small)
        var = 0.0
        for i in idx:
            if self.computed[i]:
                rms = math.sqrt(self._sumsq[i] / (self.rows * self.cols))
                var += (ROUNDING_STD_FACTOR * 2.0**-24 * rms * edge) ** 2
        return NOISE_EDGE * math.sqrt(var)

    def spectrum(self, g: torch.Tensor) -> Spectrum:
        return spectrum_from_gram(g, self.shape)

    def left_gram(self, left: Callable[[list[torch.Tensor]], torch.Tensor], width: int) -> torch.Tensor:
        """``ZᵀZ`` of the left basis ``Z`` whose row blocks ``left(xs)`` gives (one pass)."""
        c = torch.zeros((width, width), dtype=torch.float64, device=self.device)
        if width == 0:
            return c
        for _, xs in self:
            gram_add_(c, left(xs))
        return c

    def whole(self) -> list[torch.Tensor]:
        """The tall forms ``X_i`` (N × M float64) of every task vector, whole (one pass, written
        into one preallocated matrix each)."""
        out = [
            torch.empty((self.big, self.small), dtype=torch.float64, device=self.device)
            for _ in range(self.n)
        ]
        r0 = 0
        for _, xs in self:
            for o, x in zip(out, xs, strict=True):
                o[r0 : r0 + x.shape[0]] = x
            r0 += xs[0].shape[0]
        return out

    def output(
        self, left: Callable[[list[torch.Tensor]], torch.Tensor], k: torch.Tensor | None
    ) -> Iterator[torch.Tensor]:
        """The output pass: ``W_base + Z_b·K`` in the output dtype, in order (``k`` None: ``left``
        gives the update's rows themselves); rows beyond the shared ones (a resized vocabulary)
        keep the first fine-tune's values."""
        job = self.job
        out_dtype = torch_dtype(job.out_dtype)
        work = current() if self.device.type == "cpu" else None
        full = None if self.tall else torch.empty((self.rows, self.cols), dtype=out_dtype)
        c0 = 0
        for b, xs in self:
            if k is None:
                out = b.add_(left(xs))
            else:
                out = b.addmm_(left(xs), k) if k.shape[0] else b
            if not all_finite(out):
                # the inputs are finite here (the plan refused non-finite ones): the strength
                # overflowed (iso-c with --alpha 1e308 reported "the merge produced NaN/Inf", exit 3)
                raise InputError(
                    f"tensor {job.name!r}: the merged update overflows {out.dtype} from finite inputs",
                    advice=strength_advice(out.dtype),
                )
            cast = out.to(out_dtype)
            if work is not None and work.owns(cast):  # float64 out: the block itself, copied
                cast = cast.clone()
            if not all_finite(cast):
                raise InputError(
                    f"tensor {job.name!r}: the merged values exceed {job.out_dtype}'s range",
                    advice=strength_advice(job.out_dtype),
                )
            if full is None:
                yield cast.cpu()
            else:
                full[:, c0 : c0 + out.shape[0]] = cast.T.cpu()
                c0 += out.shape[0]
        if full is not None:
            yield full
        if job.shared_rows is not None and job.shape[0] > self.rows:
            yield cast_out(self.src.ft(0, (self.rows, job.shape[0])), job.out_dtype, job.name)


def check_accurate_route(
    blocks: TallBlocks, device: torch.device, why: str, written: str, bound: float
) -> None:
    """InputError naming the tensor, ``why`` the Gram route does not do, and what to do, when the
    accurate route's float64 SVDs of this matrix cannot fit in the memory this process may use."""
    need = svd_route_bytes(blocks.big, blocks.small, blocks.n)
    budget = over_budget(need, device)
    if budget is not None:
        raise InputError(
            f"tensor {blocks.job.name!r}: {why}, and the accurate SVD route needs about "
            f"{need / 1e9:.1f} GB, more than {budget}; {coarser_output_hint(written, bound)}"
        )


def _sum(xs: Sequence[torch.Tensor], work: Scratch | None = None) -> torch.Tensor:
    """``Σ_i X_i`` of one step's blocks (in ``work``'s buffer when given, the layout of ``xs[0]``)."""
    if work is None:
        s = xs[0].clone()
    else:  # the same strides as xs[0] (a wide matrix's blocks are transposed views)
        x0 = xs[0]
        buf = work.take("tall.sum", x0.T.shape if not x0.is_contiguous() else x0.shape, x0.dtype, x0.device)
        s = (buf.T if not x0.is_contiguous() else buf).copy_(x0)
    for x in xs[1:]:
        s.add_(x)
    return s


@dataclass
class Result:
    """What a method's plan for one matrix hands the output pass."""

    left: Callable[[list[torch.Tensor]], torch.Tensor]  # row blocks of the left basis Z
    kernel: torch.Tensor  # K (R × M)
    rank: int  # rank of the merged update
    amplification: float  # the largest λ_max/λ_min inverted on the way
    stats: dict  # per-tensor report entries
    #: the same merge by the accurate route (:mod:`.subspace_svd`), from the whole tall task vectors
    accurate: Callable[[list[torch.Tensor]], SvdResult]


class SubspaceMergeOp:
    """A subspace merge on every eligible matrix, the average of the deltas (times α) elsewhere.

    ``plan(blocks) -> Result`` is the method: the passes it needs over ``blocks`` before the
    output pass (statistics, Gram matrices), and the output pass's left basis and kernel.
    """

    def __init__(
        self,
        name: str,
        plan: Callable[[TallBlocks], Result],
        alpha: float,
        device: torch.device,
        is_matrix: Callable[[TensorJob], bool],
        block_bytes: int,
    ) -> None:
        self.name, self.plan, self.alpha = name, plan, alpha
        self.device, self.is_matrix, self.block_bytes = device, is_matrix, block_bytes
        self.average = ElementwiseMergeOp(
            lambda job: TaskArithmeticKernel([alpha / len(job.fts)] * len(job.fts), 1.0), device, block_bytes
        )

    def __call__(self, job: TensorJob, src: JobInputs, rec: dict) -> Iterator[torch.Tensor]:
        if not self.is_matrix(job):
            rec["merge_rule"] = "average"
            yield from self.average(job, src, rec)
            return
        blocks = TallBlocks(job, src, self.device, self.block_bytes)
        try:
            res = self.plan(blocks)
        except NonFiniteInput:
            if not src.allow_nonfinite:
                raise
            yield from kept_nonfinite(job, src, rec)
            return
        bound = EPS64 * gram_growth(blocks.big) * res.amplification
        written = job.final_dtype or job.out_dtype  # a schedule's wide intermediate is not what is written
        tol = tolerance(written)
        rec.update(
            {
                "merge_rule": self.name,
                "route": ROUTE,
                "rank": res.rank,  # of Δ* (no ``rank_kept``: that key means a DG-Hard cut to reports)
                "error_bound": float(f"{bound:.4g}"),
                **res.stats,
            }
        )
        if bound <= tol:
            yield from blocks.output(res.left, res.kernel)
            return
        # the Gram route's bound is too loose for the written dtype: the accurate route
        check_accurate_route(
            blocks,
            self.device,
            f"--method {self.name} divides by singular values down to "
            f"1/{math.sqrt(res.amplification):.3g} of the largest here; the float64 Gram route's "
            f"error bound {bound:.1e} exceeds the {written} output's resolution {tol:.1e}",
            written,
            bound,
        )
        acc = res.accurate(blocks.whole())
        bound_svd = EPS64 * acc.kappa
        assert bound_svd <= tol, (job.name, bound_svd)  # the rank floor keeps it below float32's
        rec.update(
            {
                "route": SVD_ROUTE,
                "rank": acc.rank,
                "error_bound": float(f"{bound_svd:.4g}"),
                "gram_error_bound": float(f"{bound:.4g}"),
                **acc.stats,
            }
        )
        rows = iter(torch.split(acc.delta, blocks.step))
        yield from blocks.output(lambda xs: next(rows), None)


def matrix_rule(policy) -> Callable[[TensorJob], bool]:
    """DG-Hard's rule for a matrix that gets the spectral treatment: 2-D, at least 2 rows, at least
    ``--min-numel`` entries (the shared rows of a resized vocabulary), selected."""
    matrix = matrix_eligibility(policy)

    def is_matrix(job: TensorJob) -> bool:
        rows = job.shared_rows if job.shared_rows is not None else (job.shape[0] if job.shape else 0)
        return (
            len(job.shape) == 2
            and rows >= 2
            and job.shape[1] >= 2
            and rows * job.shape[1] >= policy.min_numel
            and matrix(job.name, job.fts[0]) is None
        )

    return is_matrix


def merge_summary(rule: str) -> Callable[[list[dict], dict], dict]:
    """The report's ``merge`` totals of a subspace merge."""

    def summary(rows: list[dict], p: dict) -> dict:
        spectral = [r for r in rows if r.get("merge_rule") == rule]
        out: dict = {"subspace_matrices": len(spectral), "averaged_tensors": len(rows) - len(spectral)}
        if spectral:
            ranks = sorted(r["rank"] for r in spectral)
            out["median_rank"] = ranks[len(ranks) // 2]
            out["error_bound_max"] = max(r["error_bound"] for r in spectral)
            accurate = sum(r["route"] == SVD_ROUTE for r in spectral)
            if accurate:  # matrices whose Gram-route bound was too loose for the output dtype
                out["accurate_route_matrices"] = accurate
        return out

    return summary
