"""SVC, singular value calibration, a post-step for any merge (``--calibrate svc``).

"When Shared Knowledge Hurts: Spectral Over-Accumulation in Model Merging" (ICML 2026, arXiv
2602.05536): directions that several task vectors share add up in a merge, so their singular
values come out too large. Per eligible weight matrix, with the merged update
ΔW_m = W_merged − W_base = U·diag(σ)·Vᵀ (thin SVD), T task vectors Δ_i = W_i − W_base, and
α (``--svc-alpha``, default 0.1):

    a_rⁱ = u_rᵀ·Δ_i,   a_rᵐ = u_rᵀ·ΔW_m = σ_r·v_rᵀ
    s_rⁱ = ⟨a_rᵐ, a_rⁱ⟩ / ‖a_rⁱ‖²            (how far the merge overshoots task i along u_r)
    γ_r  = T / Σ_i max(α, s_rⁱ)
    W    = W_base + U·diag(γ·σ)·Vᵀ

as the paper's code and FusionBench compute it (γ is not clamped: it lies in (0, 1/α]; a task
with no component along u_r, ‖a_rⁱ‖ = 0, counts as α, as FusionBench's guard gives). Eligible
matrices are the subspace merges' (2-D, both sides ≥ 2, at least ``--min-numel`` entries,
vocabulary matrices included, as FusionBench's "every 2-D parameter"); other tensors keep the
merge's values. With a layer schedule the calibration comes first: W = W_base + λ(ℓ)·ΔW_svc.

The wrapped merge writes the matrix in float64, held whole (8·m·n bytes). The calibration then
takes the **streaming Gram route** of the spectral merges, in the tall form X (X = ΔW when m ≥ n,
else ΔWᵀ; N × M, M = min(m, n)): one pass over row blocks accumulates G = X_mᵀX_m and
P_i = X_mᵀX_i (and, for a wide matrix, X_iᵀX_i), M × M each; the eigendecomposition G = Q·Λ·Qᵀ
gives the singular values and the directions the formula needs without any N × M factor:

    m ≥ n (Q = V):  ⟨a_rᵐ, a_rⁱ⟩ = q_rᵀ·P_i·q_r,   ‖a_rⁱ‖² = ‖P_iᵀ·q_r‖² / λ_r
    m < n (Q = U):  ⟨a_rᵐ, a_rⁱ⟩ = q_rᵀ·P_i·q_r,   ‖a_rⁱ‖² = q_rᵀ·(X_iᵀX_i)·q_r

and the output pass writes X_m·(I + K), K = Q·diag(γ − 1)·Qᵀ, block by block: the merge's own
update wherever γ = 1. Working set (:func:`svc_bytes`): the merged matrix, up to (2T + 7) M × M
float64 matrices and one set of row blocks (a wide matrix's inputs are read whole, as in every
spectral pass, and its output assembled whole); 3 fine-tunes of a 0.5B model's 151936 × 896
embedding: about 1.3 GB, against 8.7 GB for the dense SVD.

Accuracy: the Gram matrices are known to about √N·ε·λ_max (measured: 0.1·√N·ε·λ_max), so a
direction's singular vector to that over its eigenvalue's distance to another cluster's, and
each γ to an interval computed from those errors. Each record's ``svc.error_bound`` bounds the
calibrated update's error relative to σ_max, to first order: the sum of the γ intervals' widths
times σ_r, the directions' mixing times the γ differences, and the directions at the route's
floor (σ² ≤ 4·M·ε·σ_max², unresolved: left as the merge wrote them, each off by at most
max(1, 1/α − 1)·σ); it is infinite where a gap between singular values lies within their error
of the cluster threshold. A matrix whose bound exceeds the output dtype's resolution (float32's
at the finest; a float32 output of a rank-deficient merged update, say) is calibrated again by
the **accurate route**: the thin float64 SVD of the whole merged update, one task vector at a
time (working set ≈ 8·8·m·n bytes, checked against the memory budget before that matrix is
computed, :func:`svc_dense_bytes`); its record says ``route: "svd-float64"`` and keeps the Gram
route's bound as ``gram_error_bound`` (null where infinite).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from dghard_cli.engine.ops import JobInputs, TensorOp, all_finite, cast_out, strength_advice
from dghard_cli.engine.plan import TensorJob
from dghard_cli.engine.working_memory import over_budget
from dghard_cli.errors import InputError
from dghard_cli.io.safetensors_format import UNIT_ROUNDOFF, torch_dtype
from dghard_cli.methods.low_rank import numerical_rank, report_bound
from dghard_cli.methods.subspace_svd import ROUTE as SVD_ROUTE
from dghard_cli.methods.subspace_svd import svd64
from dghard_cli.spectral.routes import GRAM_FLOOR, block_rows, gram_growth
from dghard_cli.spectral.spectrum import ROUTE as GRAM_ROUTE

#: The default floor of the overshoot ratios (the paper's README and FusionBench's configurations
#: for task arithmetic, TIES, DARE and Iso-C; FusionBench uses 1.0 for TSV-M).
SVC_ALPHA = 0.1
#: The dtype the wrapped merge writes in (the calibration casts once).
WIDE = "F64"
EPS64 = 2.0**-52
FINEST = 2.0**-24  # the finest resolution singular values are told apart at (float32's)
#: Both routes' own rounding, in units of M·ε (what the products and the SVD cost; measured ≤ 4)
ROUNDING = 16


def clusters(sigma: torch.Tensor, unit: float) -> torch.Tensor:
    """A cluster index per singular value (descending): a new cluster wherever the next value is
    more than ``ε·σ_max/unit`` below the last (values the output cannot tell apart share one)."""
    if sigma.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    delta = EPS64 * float(sigma[0]) / unit
    gaps = (sigma[:-1] - sigma[1:]) > delta
    return torch.cat([torch.zeros(1, dtype=torch.long, device=sigma.device), gaps.long().cumsum(0)])


def calibrate(
    delta_m: torch.Tensor, deltas: Iterable[torch.Tensor], alpha: float, unit: float = 2.0**-24
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The accurate route: the calibrated merged update of ``delta_m`` (float64), the factors γ and
    the singular values σ (pure), from the thin SVD of the whole matrix.

    ``deltas``: the task vectors, used one at a time (a generator that makes each when it is
    needed keeps one in memory, not T).

    Singular values the output cannot tell apart (``unit``: its unit roundoff; an Iso-C merge's
    flat spectrum is one such cluster) have no defined singular directions of their own — any
    rotation within their span is as good an SVD — so each cluster c gets one γ from
    s_cⁱ = Σ_{r∈c} ⟨σ_r·v_r, a_rⁱ⟩ / Σ_{r∈c} ‖a_rⁱ‖² (the same for every basis of the cluster);
    distinct singular values, the usual case, are the paper's formula exactly."""
    u, sigma, vh = svd64(delta_m)
    c = clusters(sigma, unit)
    n_c = int(c[-1]) + 1 if c.numel() else 0
    total = torch.zeros(n_c, dtype=sigma.dtype, device=sigma.device)
    n_tasks = 0
    for d in deltas:
        n_tasks += 1
        a = u.T @ d  # rows a_rⁱ
        den = torch.zeros_like(total).index_add_(0, c, (a * a).sum(dim=1))
        num = torch.zeros_like(total).index_add_(0, c, sigma * (a * vh).sum(dim=1))  # ⟨σ_r·v_r, a_rⁱ⟩
        s = torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0)
        total += torch.clamp(s, min=alpha)
        del d, a
    gamma = (n_tasks / total)[c]
    return (u * (gamma * sigma)) @ vh, gamma, sigma


@dataclasses.dataclass(frozen=True)
class GramCalibration:
    """SVC of one matrix on the Gram route: the output pass's kernel and how exact it is."""

    kernel: torch.Tensor  # K = Q·diag(γ − 1)·Qᵀ (M × M float64): the update's rows become X·(I + K)
    gamma: torch.Tensor  # γ of each resolved direction (descending σ)
    rank: int  # directions above the route's floor (the others keep the merge's values)
    bound: float  # error bound of the calibrated update, relative to σ_max


def gram_calibration(
    gram: torch.Tensor,
    products: Sequence[torch.Tensor],
    task_grams: Sequence[torch.Tensor] | None,
    norms: Sequence[float],
    alpha: float,
    unit: float,
    rows: int,
) -> GramCalibration:
    """:func:`calibrate`'s factors from M × M matrices of the tall form (pure): ``gram`` X_mᵀX_m,
    ``products`` X_mᵀX_i, ``task_grams`` X_iᵀX_i for a wide matrix (None for a tall one: its u_r
    are X_m's left vectors), ``norms`` ‖X_i‖_F (for the bound), ``rows`` N (the tall form's rows,
    which the products' rounding grows with). The same clusters, the same formula; directions at
    the route's floor (σ² ≤ 4·M·ε·σ_max²) keep γ = 1; a task vector that is zero here has s = 0
    exactly, as on the dense route.

    The bound (first order in the rounding): G and the products are known to e = √N·ε·λ_max and
    √N·ε·σ_max·‖X_i‖ (measured: about 0.1·√N·ε·λ_max for N from 300 to 150 000); a direction q_r
    moves towards q_j by at most c_rj = e/|λ_r − λ_j| (0 within a cluster, whose γ does not
    depend on its basis). From those, each cluster's s_cⁱ lies in an interval and γ_c in
    [T/Σ hi, T/Σ lo]. The update is off by at most the sum of (γ_hi − γ_lo)·σ_r along each
    direction, ‖[σ_j·|γ_r − γ_j|·c_rj]‖_F through the directions' mixing, and
    max(1, 1/α − 1)·σ along the directions at the floor (their γ unknown). A gap between
    neighbouring singular values within their error (e/2σ each) of the cluster threshold is a
    decision rounding makes (on the dense route too): the bound is then infinite."""
    m = gram.shape[0]
    dev = gram.device
    n_tasks = len(products)
    lam, q = torch.linalg.eigh(0.5 * (gram + gram.T))
    lam, q = lam.flip(0), q.flip(1)
    lam_max = max(float(lam[0]), 0.0) if m else 0.0
    empty = torch.zeros(0, dtype=torch.float64, device=dev)
    if not lam_max > 0.0 or n_tasks == 0:
        return GramCalibration(torch.zeros((m, m), dtype=torch.float64, device=dev), empty, 0, 0.0)
    floor = GRAM_FLOOR * m * EPS64 * lam_max
    rank = int(torch.count_nonzero(lam > floor))
    lr, qr = lam[:rank], q[:, :rank]
    sigma = lr.sqrt()
    c = clusters(sigma, unit)
    n_c = int(c[-1]) + 1
    grow = gram_growth(rows)
    e_g = grow * EPS64 * lam_max  # G's error, and each eigenvalue's
    sig_max = math.sqrt(lam_max)
    # every direction's σ (at the floor: as large as it could be), and the couplings c_rj
    sig_all = torch.cat([sigma, (lam[rank:].clamp(min=0.0) + e_g).sqrt()])
    ids = torch.cat([c, torch.full((m - rank,), n_c, dtype=c.dtype, device=dev)])
    gap = (lr[:, None] - lam[None, :]).abs_()
    coup = torch.where(c[:, None] == ids[None, :], 0.0, (e_g / gap).clamp_(max=1.0))
    del gap
    zeros = lambda: torch.zeros(n_c, dtype=torch.float64, device=dev)  # noqa: E731
    total, t_lo, t_hi = zeros(), zeros(), zeros()
    for i, p in enumerate(products):
        f = float(norms[i])
        if f == 0.0:  # a zero task vector: s = 0 exactly (no component along any u_r)
            for t in (total, t_lo, t_hi):
                t += alpha
            continue
        w = p.T @ q  # column j: P_iᵀ·q_j
        num_r = (w[:, :rank] * qr).sum(dim=0)
        if task_grams is None:  # tall: ‖a_rⁱ‖ = ‖P_iᵀ·q_r‖ / σ_r
            wn = torch.linalg.vector_norm(w, dim=0)
            wn[rank:] = f * sig_all[rank:]  # a direction at the floor: ‖X_iᵀX_m·q‖ ≤ ‖X_i‖·σ
            mixed = coup @ torch.stack([torch.ones_like(wn), wn], dim=1)
            e_w = grow * EPS64 * sig_max * f + mixed[:, 1]
            wr = wn[:rank]
            den_r = wr**2 / lr
            den_lo_r = torch.clamp(wr - e_w, min=0.0) ** 2 / (lr + e_g)
            den_hi_r = (wr + e_w) ** 2 / (lr - e_g)
            e_num = e_w + wr * mixed[:, 0]
        else:  # wide: ‖a_rⁱ‖² = q_rᵀ·(X_iᵀX_i)·q_r
            den_all = ((task_grams[i] @ q) * q).sum(dim=0).clamp_(min=0.0)
            root = den_all.sqrt()
            mixed = coup @ torch.stack([root, sig_all], dim=1)
            den_r = den_all[:rank]
            e_den = grow * EPS64 * f * f + 2.0 * root[:rank] * mixed[:, 0]
            den_lo_r, den_hi_r = den_r - e_den, den_r + e_den
            e_num = grow * EPS64 * sig_max * f + root[:rank] * mixed[:, 1] + sigma * mixed[:, 0]
        sums = [zeros().index_add_(0, c, v) for v in (num_r, e_num, den_r, den_lo_r, den_hi_r)]
        num, e, den, den_lo, den_hi = sums
        s = torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0)
        total += torch.clamp(s, min=alpha)
        lo, hi = _ratio_interval(num - e, num + e, den_lo, den_hi)
        t_lo += torch.clamp(lo, min=alpha)
        t_hi += torch.clamp(hi, min=alpha)
    gamma = n_tasks / total
    g_lo, g_hi = n_tasks / t_hi, n_tasks / t_lo  # t_hi may be inf: γ_lo 0
    g_r = gamma[c]
    width = float(((g_hi - g_lo)[c] * sigma).max()) / sig_max
    g_all = torch.cat([g_r, torch.ones(m - rank, dtype=torch.float64, device=dev)])
    mixing = (
        float(torch.linalg.matrix_norm(coup * sig_all[None, :] * (g_r[:, None] - g_all[None, :]))) / sig_max
    )
    edge = max(1.0, 1.0 / alpha - 1.0) * math.sqrt((floor + e_g) / lam_max) if rank < m else 0.0
    bound = width + mixing + edge + rounding_bound(m, g_r)
    # the cluster decisions: a gap within the σ's error of the threshold ε·σ_max/unit
    err_sig = e_g / (2.0 * sigma)
    near = ((sigma[:-1] - sigma[1:]) - EPS64 * float(sigma[0]) / unit).abs() <= err_sig[:-1] + err_sig[1:]
    if bool(near.any()):
        bound = math.inf
    kernel = (qr * (g_r - 1.0)) @ qr.T
    return GramCalibration(kernel, g_r, rank, bound)


def _ratio_interval(
    n_lo: torch.Tensor, n_hi: torch.Tensor, d_lo: torch.Tensor, d_hi: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The range of n / d over the intervals (−inf, inf where d may be 0)."""
    safe = d_lo > 0
    d_lo_s = torch.where(safe, d_lo, 1.0)
    d_hi_s = torch.where(safe, d_hi, 1.0)
    cands = torch.stack([n_lo / d_lo_s, n_lo / d_hi_s, n_hi / d_lo_s, n_hi / d_hi_s])
    inf = torch.full_like(n_lo, math.inf)
    return torch.where(safe, cands.min(dim=0).values, -inf), torch.where(safe, cands.max(dim=0).values, inf)


def svc_bytes(rows: int, cols: int, n_fts: int) -> int:
    """The Gram route's float64 working set for one m × n matrix (see the module's docstring): the
    merged matrix and up to (2T + 7) M × M matrices (G, the products, a wide matrix's task Gram
    matrices, the eigenvectors and the eigensolver's workspace, the couplings, one product's
    projection, the kernel); a wide matrix's inputs and output whole (4 bytes a value counted).
    The row blocks (``block_bytes``) come on top."""
    small = min(rows, cols)
    whole = (n_fts + 2) * 4 * rows * cols if rows < cols else 0  # the inputs, and the output
    return 8 * rows * cols + (2 * n_fts + 7) * 8 * small * small + whole


def svc_dense_bytes(rows: int, cols: int, n_fts: int) -> int:  # noqa: ARG001 - T does not matter
    """The accurate route's float64 working set for one m × n matrix: the merged matrix, BASE, the
    merged update, the SVD's factors and workspace, one task vector and its projection."""
    return 8 * 8 * rows * cols


def _wide(block: torch.Tensor) -> torch.Tensor:
    if block.dtype == torch.uint8:  # a passed-through block: raw bytes of the wide dtype
        block = block.contiguous().clone().view(torch.float64)
    return block.to(torch.float64).reshape(-1)


class CalibratedOp:
    """The merge's operation, then SVC on every eligible matrix."""

    def __init__(
        self,
        inner: TensorOp,
        alpha: float,
        is_matrix: Callable[[TensorJob], bool],
        device: torch.device,
        block_bytes: int = 64 * 1024 * 1024,
    ):
        self.inner, self.alpha, self.is_matrix, self.device = inner, alpha, is_matrix, device
        self.block_bytes = block_bytes

    def __call__(self, job: TensorJob, src: JobInputs, rec: dict) -> Iterator[torch.Tensor]:
        if not self.is_matrix(job):
            yield from self.inner(job, src, rec)
            return
        rows = job.shared_rows if job.shared_rows is not None else job.shape[0]
        # the working set was checked for every matrix before anything was written (merging.py)
        wide_job = dataclasses.replace(job, out_dtype=WIDE, final_dtype=job.final_dtype or job.out_dtype)
        merged = torch.empty(job.shape, dtype=torch.float64)
        flat, at = merged.view(-1), 0
        for b in self.inner(wide_job, src, rec):
            b = _wide(b)
            flat[at : at + b.numel()] = b
            at += b.numel()
        if rec.get("nonfinite"):  # kept as it was (--allow-nonfinite)
            yield cast_out(merged, job.out_dtype, job.name)
            return
        written = job.final_dtype or job.out_dtype
        unit = max(UNIT_ROUNDOFF.get(written, FINEST), FINEST)
        tall = _TallForm(job, src, merged, rows, self.device, self.block_bytes)
        cal = tall.calibration(self.alpha, unit)
        rec["svc"] = {"route": GRAM_ROUTE, "rank": cal.rank, **_gamma_range(cal.gamma)}
        rec["svc"]["error_bound"] = report_bound(cal.bound)
        if cal.bound <= unit:
            yield from tall.output(cal.kernel)
        else:
            yield self._accurate(job, src, merged, rows, unit, cal.bound, rec)
        if rows < job.shape[0]:  # rows a resized vocabulary added: the merge's values
            yield cast_out(merged[rows:], job.out_dtype, job.name)

    def _accurate(
        self,
        job: TensorJob,
        src: JobInputs,
        merged: torch.Tensor,
        rows: int,
        unit: float,
        bound: float,
        rec: dict,
    ) -> torch.Tensor:
        """The matrix calibrated from the SVD of the whole merged update (the Gram route's bound
        exceeded the output's resolution ``unit``)."""
        need = svc_dense_bytes(rows, job.shape[1], len(job.fts))
        budget = over_budget(need, self.device)
        if budget is not None:
            from dghard_cli.methods.subspace import coarser_output_hint

            raise InputError(
                f"tensor {job.name!r}: --calibrate svc's Gram route is accurate to {bound:.1e} here, "
                f"coarser than the output's resolution {unit:.1e}, and the accurate SVD route needs about "
                f"{need / 1e9:.1f} GB, more than {budget}; "
                f"{coarser_output_hint(job.final_dtype or job.out_dtype, bound)}"
            )
        dev = self.device
        base = src.base().to(device=dev, dtype=torch.float64)[:rows]
        # each task vector made when calibrate() reaches it, and freed after: one in memory, not T
        deltas = (src.ft(i).to(device=dev, dtype=torch.float64)[:rows] - base for i in range(len(job.fts)))
        delta, gamma, sigma = calibrate(merged[:rows].to(dev) - base, deltas, self.alpha, unit)
        out = base.add_(delta)
        _check_finite(out, job)
        small = min(rows, job.shape[1])
        # the directions above the Gram route's floor, as its record counts them (the others hold
        # rounding: their γ is as arbitrary as their direction)
        rank = numerical_rank(sigma.cpu().numpy(), small)
        rec["svc"].update(
            {
                "route": SVD_ROUTE,
                "rank": rank,
                **_gamma_range(gamma[:rank]),
                "error_bound": report_bound(rounding_bound(small, gamma)),
                "gram_error_bound": report_bound(bound),
            }
        )
        return cast_out(out.cpu(), job.out_dtype, job.name)


class _TallForm:
    """One matrix's calibration passes in the tall form: X_m (the merged update, from the merged
    matrix held whole) and X_i, in row blocks (columns of a wide matrix, its inputs read whole)."""

    def __init__(
        self,
        job: TensorJob,
        src: JobInputs,
        merged: torch.Tensor,
        rows: int,
        device: torch.device,
        block: int,
    ) -> None:
        self.job, self.src, self.merged, self.rows, self.device = job, src, merged, rows, device
        self.cols = job.shape[1]
        self.tall = rows >= self.cols
        self.small = min(rows, self.cols)
        self.n = len(job.fts)
        self.step = block_rows(self.small, max(1, block // (self.n + 3)))

    def _f64(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=torch.float64, copy=True)

    def blocks(self, with_tasks: bool) -> Iterator[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]]:
        """``(BASE block, merged block, [X_i blocks])`` in the tall form, float64 on the device."""
        src, n = self.src, (self.n if with_tasks else 0)
        if self.tall:
            for r0 in range(0, self.rows, self.step):
                r = (r0, min(r0 + self.step, self.rows))
                b = self._f64(src.base(r))
                yield (
                    b,
                    self._f64(self.merged[r[0] : r[1]]),
                    [self._f64(src.ft(i, r)).sub_(b) for i in range(n)],
                )
            return
        base = src.base()[: self.rows]
        fts = [src.ft(i)[: self.rows] for i in range(n)]
        for c0 in range(0, self.cols, self.step):
            c = slice(c0, min(c0 + self.step, self.cols))
            b = self._f64(base[:, c]).T
            yield b, self._f64(self.merged[: self.rows, c]).T, [self._f64(f[:, c]).T.sub_(b) for f in fts]

    def calibration(self, alpha: float, unit: float) -> GramCalibration:
        """One pass: X_mᵀX_m, X_mᵀX_i (and X_iᵀX_i for a wide matrix), then the factors."""
        m, dev = self.small, self.device
        zeros = lambda: torch.zeros((m, m), dtype=torch.float64, device=dev)  # noqa: E731
        gram, products = zeros(), [zeros() for _ in range(self.n)]
        task_grams = None if self.tall else [zeros() for _ in range(self.n)]
        sumsq = [torch.zeros((), dtype=torch.float64, device=dev) for _ in range(self.n)]
        for b, mb, xs in self.blocks(with_tasks=True):
            xm = mb.sub_(b)
            gram.addmm_(xm.T, xm)
            for i, x in enumerate(xs):
                products[i].addmm_(xm.T, x)
                if task_grams is not None:
                    task_grams[i].addmm_(x.T, x)
                sumsq[i] += torch.linalg.vector_norm(x) ** 2
        for g in [gram, *products, *(task_grams or [])]:
            if not bool(torch.isfinite(g).all()):
                raise InputError(
                    f"tensor {self.job.name!r}: the merged update's Gram matrix overflows float64",
                    advice=strength_advice(torch.float64),
                )
        norms = [math.sqrt(float(t)) for t in sumsq]
        return gram_calibration(gram, products, task_grams, norms, alpha, unit, max(self.rows, self.cols))

    def output(self, kernel: torch.Tensor) -> Iterator[torch.Tensor]:
        """The output pass: the merged block plus X_m,b·K, in the output dtype, in order."""
        job = self.job
        full = None if self.tall else torch.empty((self.rows, self.cols), dtype=torch_dtype(job.out_dtype))
        c0 = 0
        for b, mb, _ in self.blocks(with_tasks=False):
            out = mb.addmm(mb - b, kernel)
            _check_finite(out, job)
            cast = cast_out(out.cpu(), job.out_dtype, job.name)
            if full is None:
                yield cast
            else:
                full[:, c0 : c0 + out.shape[0]] = cast.T
                c0 += out.shape[0]
        if full is not None:
            yield full


def _check_finite(out: torch.Tensor, job: TensorJob) -> None:
    if not all_finite(out):
        raise InputError(
            f"tensor {job.name!r}: the calibrated update overflows float64", advice=strength_advice(out.dtype)
        )


def rounding_bound(order: int, gamma: torch.Tensor) -> float:
    """Both routes' own rounding relative to σ_max: ``ROUNDING·M·ε`` of the calibrated update,
    which is up to the largest γ (1/α) times the merged one."""
    return ROUNDING * order * EPS64 * max(1.0, float(gamma.max()) if gamma.numel() else 1.0)


def _gamma_range(gamma: torch.Tensor) -> dict:
    """γ's range (1 where no direction was calibrated: a zero update)."""
    lo, hi = (float(gamma.min()), float(gamma.max())) if gamma.numel() else (1.0, 1.0)
    return {"gamma_min": float(f"{lo:.6g}"), "gamma_max": float(f"{hi:.6g}")}


def wrap(
    inner: Callable[[torch.device], TensorOp],
    alpha: float,
    is_matrix: Callable[[TensorJob], bool],
    block_bytes: int = 64 * 1024 * 1024,
):
    """``make_op`` for the runner: the merge's operation calibrated by SVC."""
    return lambda device: CalibratedOp(inner(device), alpha, is_matrix, device, block_bytes)


def summary(records: list[dict]) -> dict:
    """The report's ``svc`` totals: matrices calibrated and the range of γ."""
    done = [r["svc"] for r in records if "svc" in r]
    out: dict = {"calibrated_matrices": len(done)}
    if done:
        out["gamma_min"] = min(d["gamma_min"] for d in done)
        out["gamma_max"] = max(d["gamma_max"] for d in done)
        out["error_bound_max"] = max(
            (d["error_bound"] for d in done if d["error_bound"] is not None), default=None
        )
        accurate = sum(d["route"] == SVD_ROUTE for d in done)
        if accurate:  # matrices whose Gram-route bound was too loose for the output dtype
            out["accurate_route_matrices"] = accurate
    return out
