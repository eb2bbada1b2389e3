"""WUDI: the merged update that undoes each task's interference on its own inputs, in closed form.

WUDI-Merging ("Whoever Started the Interference Should End It", Cheng et al., ICML 2025,
arXiv 2503.08099) observes that a linear layer's task vector τ_i (m × n, out × in) spans,
row-wise, about the inputs task i feeds that layer, and so chooses per weight matrix the τ that
minimises the interference it causes there:

    L(τ) = Σ_i ‖(τ − τ_i)·τ_iᵀ‖²_F / ‖τ_i‖²_F

The objective is quadratic: ∇L = 2·(τ·A − B) with A = Σ_i τ_iᵀτ_i / c_i (n × n, trace T) and
B = Σ_i τ_i·τ_iᵀ·τ_i / c_i, c_i = ‖τ_i‖²_F. The reference code starts from the sum Σ_i τ_i and
runs 300 Adam steps on it (lr 1e-5, on a GPU). Its exact minimiser B·A⁺ is reported to do worse
than the early-stopped descent (SWUDI, arXiv 2606.07289): the stopping is a regulariser.

What is computed here, and exactly: **k steps of gradient descent from Σ_i τ_i at the standard
step 1/(2·λ_max(A))** (``--steps`` k, default 300, the reference's count), in closed form. With
A = V·diag(λ)·Vᵀ each direction's error shrinks by (1 − λ_j/λ_max) per step, so

    τ_k = τ_0·e(A) + B·f(A),   e(λ) = (1 − λ/λ_max)^k,   f(λ) = (1 − e(λ))/λ  (k/λ_max at λ = 0)

a spectral filter: the directions the tasks share strongly (large λ) reach the minimiser (a
weighted average of the tasks there, instead of their sum), the weak ones stay at the sum. It
equals a float64 gradient-descent loop to rounding (tests/test_merge_wudi.py), is scale-free (A
has trace T whatever the task vectors' magnitude; Adam's lr is not), and needs one
eigendecomposition per matrix instead of 300 passes. ``--steps 0`` is task arithmetic's sum; the
minimiser is the limit of large k. The merged update is ``--alpha`` (default 1) times τ_k; other
tensors get α·the average of the deltas, as in the reference code.

Computed from float64 Gram matrices accumulated over row blocks, whichever of two equal forms
has the smaller matrix to decompose (``row_form``):

- n ≤ max(m, T·m), every tall matrix and a wide one with few columns (as SmolLM2's
  ``down_proj``, 576 × 1536, with 4 fine-tunes): A is n × n from the T Gram matrices
  G_i = τ_iᵀτ_i, read in row blocks, and τ_k = Σ_i τ_i·(e(A) + G_i·f(A)/c_i);
- a wide matrix with n > T·m (as Qwen2.5-0.5B's ``down_proj``, 896 × 4864, with 3): the same
  filter applied to the T·m × T·m matrix K of the scaled cross products Y_i·Y_jᵀ (Y_i = τ_i/√c_i,
  which has A's non-zero eigenvalues: Y·g(YᵀY) = g(YYᵀ)·Y), and τ_k = Σ_j Q_j·τ_j/√c_j with
  Q = [√c_i·I]·e(K) + [K_ii/√c_i]·f(K).

The two agree to rounding; the eigensolver's cost grows as the cube of the order, so the smaller
one is 3.4× faster for SmolLM2's ``down_proj`` (1536 against 2304). Working set: (T + 9)·8·n²
bytes (row form), 9·8·(T·m)² + the matrix read whole (cross form); checked before anything is
written.

Accuracy: e and f are polynomials of degree k in A/λ_max; the eigendecomposition's backward
error (about M·ε·λ_max) and the float64 Gram's rounding (about √N·ε·λ_max over its N rows) move
them by at most their slope times it, k/λ_max for e and k²/(2·λ_max²) for f, so the update's
relative error is below ``ε·(M + √N)·(k + k²/2)``, recorded per matrix as ``error_bound``
(ε = 2⁻⁵², M the Gram's order, N the rows it sums over). A bound above the output's resolution
is refused before anything is written, naming a smaller ``--steps``.

A zero task vector has no interference to undo (the reference divides 0 by 0): its term is left
out of L and it adds nothing. One fine-tune gives τ_k = τ_1 (it is its own minimiser).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from dghard_cli.engine.ops import JobInputs
from dghard_cli.engine.plan import TensorJob
from dghard_cli.engine.working_memory import check_dense_svd
from dghard_cli.errors import InputError
from dghard_cli.methods.merge_ops import ElementwiseMergeOp, TaskArithmeticKernel
from dghard_cli.methods.registry import INT, BuildContext, MergeMethod, Param
from dghard_cli.methods.subspace import (
    ALPHA_SWEEP_RANGE,
    NonFiniteInput,
    TallBlocks,
    kept_nonfinite,
    matrix_rule,
    tolerance,
)
from dghard_cli.spectral.routes import gram_add_, gram_growth

EPS64 = 2.0**-52
WUDI_STEPS = 300
#: ``--steps`` at most: the error bound grows as k², and 10⁵ steps leave every direction with
#: λ ≥ 10⁻⁴·λ_max converged to 1e-4 of its start.
MAX_STEPS = 100_000
ROUTE = "gram-float64"

# -- pure linear algebra --------------------------------------------------------------------------


def gd_filters(lam: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``e(λ) = (1 − λ/λ_max)^k`` and ``f(λ) = (1 − e(λ))/λ`` (``k/λ_max`` at 0) of the eigenvalues
    ``lam`` of a PSD matrix (rounding below 0 or above λ_max clamped), float64."""
    top = float(lam.max()) if lam.numel() else 0.0
    if not top > 0.0 or steps == 0:
        return torch.ones_like(lam), torch.zeros_like(lam)
    x = (lam / top).clamp(0.0, 1.0)
    log_r = torch.log1p(-x)  # −inf at λ = λ_max: e = 0 there, one step reaches the minimiser
    e = torch.exp(steps * log_r)
    one_minus_e = -torch.expm1(steps * log_r)
    f = torch.where(x > 0, one_minus_e / (x * top), torch.full_like(x, steps / top))
    return e, f


def error_bound(scale: float, steps: int) -> float:
    """The relative error bound of the filtered update (see the module docstring; ``scale``:
    :func:`bound_scale`)."""
    return EPS64 * scale * (steps + steps * steps / 2.0)


def _filtered(
    sym: torch.Tensor, steps: int, *, consume: bool = False
) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """``e(S)``, ``f(S)``, λ_max and the share of the trace in directions that converged (e < 1 %);
    ``consume``: ``sym`` may be overwritten (symmetrised in place: one matrix less)."""
    if consume:
        sym.add_(sym.T.clone()).mul_(0.5)
    else:
        sym = 0.5 * (sym + sym.T)
    lam, v = torch.linalg.eigh(sym)
    del sym
    e, f = gd_filters(lam, steps)
    pos = lam.clamp(min=0.0)
    trace = float(pos.sum())
    converged = float(pos[e < 0.01].sum()) / trace if trace > 0 else 0.0
    return (v * e) @ v.T, (v * f) @ v.T, float(lam[-1]) if lam.numel() else 0.0, converged


def tall_kernels(grams: list[torch.Tensor], steps: int) -> tuple[list[torch.Tensor], dict]:
    """A tall matrix (τ_i = X_i): ``M_i = e(A) + G_i·f(A)/c_i`` so that τ_k = Σ_i X_i·M_i
    (``grams`` is emptied: each Gram is freed as its kernel is made)."""
    c = [float(torch.trace(g)) for g in grams]
    live = [i for i, ci in enumerate(c) if ci > 0.0]
    n = grams[0].shape[0]
    if not live:
        return [torch.zeros_like(grams[0]) for _ in grams], {"lambda_max": 0.0, "converged_share": 0.0}
    a = torch.zeros_like(grams[0])
    for i in live:
        a.add_(grams[i], alpha=1.0 / c[i])
    e, f, top, conv = _filtered(a, steps, consume=True)
    del a
    out = []
    for i in range(len(grams)):
        g = grams[i]
        grams[i] = None  # type: ignore[call-overload]  # each Gram freed as its kernel is made
        if i in live:
            out.append(torch.addmm(e, g, f, alpha=1.0 / c[i]))
        else:
            out.append(torch.zeros((n, n), dtype=g.dtype, device=g.device))
        del g
    return out, {"lambda_max": top, "converged_share": conv}


def wide_kernels(
    cross: dict[tuple[int, int], torch.Tensor], n_fts: int, steps: int
) -> tuple[list[torch.Tensor], dict]:
    """A wide matrix (τ_i = X_iᵀ, X_i N × M): ``M_j = Q_jᵀ/√c_j`` from the cross products
    ``cross[i, j] = X_iᵀX_j`` (i ≤ j), so that τ_kᵀ = Σ_j X_j·M_j (see the module docstring)."""
    m = cross[0, 0].shape[0]
    ref = cross[0, 0]
    c = [float(torch.trace(cross[i, i])) for i in range(n_fts)]
    live = [i for i in range(n_fts) if c[i] > 0.0]
    zeros = [torch.zeros((m, m), dtype=ref.dtype, device=ref.device) for _ in range(n_fts)]
    if not live:
        return zeros, {"lambda_max": 0.0, "converged_share": 0.0}
    t = len(live)
    k = torch.empty((t * m, t * m), dtype=ref.dtype, device=ref.device)
    for a, i in enumerate(live):
        for b, j in enumerate(live):
            blk = cross[i, j] if i <= j else cross[j, i].T
            k[a * m : (a + 1) * m, b * m : (b + 1) * m] = blk / (math.sqrt(c[i]) * math.sqrt(c[j]))
    e, f, top, conv = _filtered(k, steps, consume=True)
    del k
    # Q = C·e(K) + D·f(K): block row a of C is √c_i·I, of D K_ii/√c_i (= √c_i·Kn_ii)
    q = torch.zeros((m, t * m), dtype=ref.dtype, device=ref.device)
    for a, i in enumerate(live):
        rows = slice(a * m, (a + 1) * m)
        q.add_(e[rows], alpha=math.sqrt(c[i]))
        q.addmm_(cross[i, i], f[rows], alpha=1.0 / math.sqrt(c[i]))
    del e, f
    for b, j in enumerate(live):
        zeros[j] = q[:, b * m : (b + 1) * m].T / math.sqrt(c[j])
    return zeros, {"lambda_max": top, "converged_share": conv}


def row_form(rows: int, cols: int, n_fts: int) -> bool:
    """Whether a rows × cols matrix is computed from its n × n Gram matrices (read in row blocks)
    rather than from the T·m × T·m cross products of a wide matrix: a tall matrix always; a wide
    one when n ≤ T·m (the smaller eigenproblem) and its working set is no larger (n close to T·m
    with many fine-tunes: T Gram matrices of n × n outweigh one T·m × T·m matrix)."""
    if rows >= cols:
        return True
    return cols <= n_fts * rows and _row_bytes(cols, n_fts) <= _cross_bytes(rows, cols, n_fts)


def bound_scale(rows: int, cols: int, n_fts: int) -> float:
    """``M + √N`` of the form taken: the eigendecomposition's backward error (about M·ε·λ_max, M
    the order) plus the float64 Gram's rounding (:func:`~dghard_cli.spectral.routes.gram_growth`
    of the N rows it sums over: the matrix's rows in the row form, its columns in the cross form)."""
    if row_form(rows, cols, n_fts):
        return cols + gram_growth(rows)
    return n_fts * rows + gram_growth(cols)


def gram_order(rows: int, cols: int, n_fts: int) -> int:
    """The order of the matrix whose eigendecomposition filters the update (``row_form``'s n, else T·m)."""
    return cols if row_form(rows, cols, n_fts) else n_fts * rows


def working_bytes(rows: int, cols: int, n_fts: int) -> int:
    """The float64 working set of one matrix (see the module docstring): a tall one's T Gram
    matrices (then kernels), A, its eigenvectors, e(A), f(A) and the eigensolver's workspace
    (n × n each; measured peaks: 79 MB for n = 1000, T = 2, 111 MB for T = 6); a wide one's
    T·m × T·m matrix, its eigenvectors, e, f, their products and the workspace (72 MB measured
    for T·m = 1000), its cross products and kernels, and the matrix read whole (base and fine-tunes,
    up to float64)."""
    return _row_bytes(cols, n_fts) if row_form(rows, cols, n_fts) else _cross_bytes(rows, cols, n_fts)


def _row_bytes(cols: int, n_fts: int) -> int:
    return (n_fts + 9) * 8 * cols * cols


def _cross_bytes(rows: int, cols: int, n_fts: int) -> int:
    tm = n_fts * rows
    return (
        9 * 8 * tm * tm + (n_fts * (n_fts + 1) // 2 + n_fts) * 8 * rows * rows + (n_fts + 1) * 8 * rows * cols
    )


# -- streaming ------------------------------------------------------------------------------------


class WudiMergeOp:
    """WUDI on every eligible matrix, α·the average of the deltas elsewhere."""

    def __init__(
        self,
        steps: int,
        alpha: float,
        device: torch.device,
        is_matrix: Callable[[TensorJob], bool],
        block_bytes: int,
    ) -> None:
        self.steps, self.alpha, self.device = steps, alpha, device
        self.is_matrix, self.block_bytes = is_matrix, block_bytes
        self.average = ElementwiseMergeOp(
            lambda job: TaskArithmeticKernel([alpha / len(job.fts)] * len(job.fts), 1.0), device, block_bytes
        )

    def _grams(self, blocks: TallBlocks) -> dict[tuple[int, int], torch.Tensor]:
        """``X_iᵀX_j`` over one pass: i = j only for a tall matrix, every i ≤ j for a wide one."""
        m, n = blocks.small, blocks.n
        pairs = [(i, i) for i in range(n)] if blocks.tall else [(i, j) for i in range(n) for j in range(i, n)]
        out = {p: torch.zeros((m, m), dtype=torch.float64, device=self.device) for p in pairs}
        for _, xs in blocks:
            for (i, j), g in out.items():
                if i == j:
                    gram_add_(g, xs[i])
                else:
                    g.addmm_(xs[i].T, xs[j])
        if not all(bool(torch.isfinite(g).all()) for g in out.values()):
            raise NonFiniteInput.of(blocks.job)
        return out

    def __call__(self, job: TensorJob, src: JobInputs, rec: dict) -> Iterator[torch.Tensor]:
        if not self.is_matrix(job):
            rec["merge_rule"] = "average"
            yield from self.average(job, src, rec)
            return
        rows = job.shared_rows if job.shared_rows is not None else job.shape[0]
        blocks = TallBlocks(
            job, src, self.device, self.block_bytes, row_form=row_form(rows, job.shape[1], len(job.fts))
        )
        try:
            grams = self._grams(blocks)
        except NonFiniteInput:
            if not src.allow_nonfinite:
                raise
            yield from kept_nonfinite(job, src, rec)
            return
        if blocks.tall:
            diag = [grams.pop((i, i)) for i in range(blocks.n)]
            kernels, stats = tall_kernels(diag, self.steps)
        else:
            kernels, stats = wide_kernels(grams, blocks.n, self.steps)
        scale = bound_scale(rows, job.shape[1], blocks.n)
        del grams
        if self.alpha != 1.0:
            for k in kernels:
                k.mul_(self.alpha)
        rec.update(
            {
                "merge_rule": "wudi",
                "route": ROUTE,
                "steps": self.steps,
                "lambda_max": float(f"{stats['lambda_max']:.6g}"),
                "converged_share": round(stats["converged_share"], 6),
                "error_bound": float(f"{error_bound(scale, self.steps):.4g}"),
            }
        )

        def left(xs: list[torch.Tensor]) -> torch.Tensor:
            out = xs[0] @ kernels[0]
            for x, k in zip(xs[1:], kernels[1:], strict=True):
                out.addmm_(x, k)
            return out

        yield from blocks.output(left, None)


# -- declared for dghard merge (see dghard_cli.methods.registry) ------------------------------------


def check_steps(value: Any, method: MergeMethod, n_fts: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_STEPS:
        raise InputError(
            f"--steps must be a whole number in [0, {MAX_STEPS}] (gradient-descent steps from the "
            f"task vectors' sum; 0 is their sum), got {value!r}"
        )
    return value


def check_plan(p: dict, jobs: Sequence[TensorJob], n_fts: int, policy: Any, device: Any) -> None:
    """Before anything is written: every matrix's float64 Gram work fits in memory, and its error
    bound meets its output's resolution (a very large ``--steps`` on a wide Gram does not)."""
    steps, is_matrix = p["steps"], matrix_rule(policy)
    check_dense_svd(
        jobs,
        n_fts=n_fts,
        is_matrix=is_matrix,
        what="--method wudi",
        device=device,
        bytes_of=working_bytes,
        work="float64 Gram matrices of the task vectors",
    )
    worst = None  # the matrix with the largest bound relative to its output's resolution
    for job in jobs:
        if not (job.runs_method and len(job.shape) == 2 and is_matrix(job)):
            continue
        rows = job.shared_rows if job.shared_rows is not None else job.shape[0]
        order = bound_scale(rows, job.shape[1], n_fts)
        tol = tolerance(job.final_dtype or job.out_dtype)
        if worst is None or order / tol > worst[0] / worst[1]:
            worst = (order, tol, job, rows)
    if worst is None:
        return
    order, tol, job, rows = worst
    bound = error_bound(order, steps)
    if bound > tol:
        top = int(math.sqrt(1.0 + 2.0 * tol / (EPS64 * order)) - 1.0)  # error_bound(order, top) <= tol
        raise InputError(
            f"tensor {job.name!r}: --method wudi with --steps {steps} has an error bound of {bound:.1e} "
            f"on this {rows}×{job.shape[1]} matrix, above the {job.final_dtype or job.out_dtype} output's "
            f"resolution {tol:.1e}; give --steps {top} or fewer"
            + (", or write --dtype bf16" if tolerance("BF16") > tol and bound <= tolerance("BF16") else "")
        )


def _wudi_op(p: dict, ctx: BuildContext) -> WudiMergeOp:
    return WudiMergeOp(p["steps"], p["alpha"], ctx.device, matrix_rule(ctx.options.policy), ctx.block_bytes)


def _summary(rows: list[dict], p: dict) -> dict:
    done = [r for r in rows if r.get("merge_rule") == "wudi"]
    out: dict = {"wudi_matrices": len(done), "averaged_tensors": len(rows) - len(done)}
    if done:
        shares = sorted(r["converged_share"] for r in done)
        out["median_converged_share"] = shares[len(shares) // 2]
        out["error_bound_max"] = max(r["error_bound"] for r in done)
    return out


PARAMS = (
    Param(
        "steps",
        INT,
        "wudi: gradient steps from the task vectors' sum (default 300).",
        default=WUDI_STEPS,
        check=check_steps,
    ),
)
MERGE_METHODS = (
    MergeMethod(
        "wudi",
        ("alpha", "steps"),
        _wudi_op,
        summary=_summary,
        check_plan=check_plan,
        defaults={"alpha": 1.0},
        sweep_axes=("alpha",),
        sweep_fixed=("steps",),
        sweep_ranges={"alpha": ALPHA_SWEEP_RANGE},
        core_space="lossless",
    ),
)
