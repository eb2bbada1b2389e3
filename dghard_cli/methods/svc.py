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

The wrapped merge writes the matrix in float64; the calibration works on the whole matrix in
float64, one task vector at a time (working set ≈ 8·8·m·n bytes whatever T: the merged matrix,
BASE, the merged update, the SVD's factors and workspace, one task vector and its projection;
checked against the machine's memory first, :func:`svc_bytes`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator

import torch

from dghard_cli.engine.ops import JobInputs, TensorOp, cast_out, strength_hint
from dghard_cli.engine.plan import TensorJob
from dghard_cli.errors import InputError
from dghard_cli.io.safetensors_format import UNIT_ROUNDOFF
from dghard_cli.methods.subspace_svd import svd64

#: The default floor of the overshoot ratios (the paper's README and FusionBench's configurations
#: for task arithmetic, TIES, DARE and Iso-C; FusionBench uses 1.0 for TSV-M).
SVC_ALPHA = 0.1
#: The dtype the wrapped merge writes in (the calibration casts once).
WIDE = "F64"
EPS64 = 2.0**-52
FINEST = 2.0**-24  # the finest resolution singular values are told apart at (float32's)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """The calibrated merged update of ``delta_m`` (float64) and the factors γ (pure).

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
    return (u * (gamma * sigma)) @ vh, gamma


def svc_bytes(rows: int, cols: int, n_fts: int) -> int:  # noqa: ARG001 - T does not matter
    """The calibration's float64 working set for one m × n matrix (see the module's docstring)."""
    return 8 * 8 * rows * cols


def _wide(block: torch.Tensor) -> torch.Tensor:
    if block.dtype == torch.uint8:  # a passed-through block: raw bytes of the wide dtype
        block = block.contiguous().clone().view(torch.float64)
    return block.to(torch.float64).reshape(-1)


class CalibratedOp:
    """The merge's operation, then SVC on every eligible matrix."""

    def __init__(
        self, inner: TensorOp, alpha: float, is_matrix: Callable[[TensorJob], bool], device: torch.device
    ):
        self.inner, self.alpha, self.is_matrix, self.device = inner, alpha, is_matrix, device

    def __call__(self, job: TensorJob, src: JobInputs, rec: dict) -> Iterator[torch.Tensor]:
        if not self.is_matrix(job):
            yield from self.inner(job, src, rec)
            return
        rows = job.shared_rows if job.shared_rows is not None else job.shape[0]
        # the working set was checked for every matrix before anything was written (merging.py)
        wide_job = dataclasses.replace(job, out_dtype=WIDE, final_dtype=job.final_dtype or job.out_dtype)
        merged = torch.cat([_wide(b) for b in self.inner(wide_job, src, rec)]).reshape(job.shape)
        if rec.get("nonfinite"):  # kept as it was (--allow-nonfinite)
            yield cast_out(merged, job.out_dtype, job.name)
            return
        dev = self.device
        base = src.base().to(device=dev, dtype=torch.float64)[:rows]
        # each task vector made when calibrate() reaches it, and freed after: one in memory, not T
        deltas = (src.ft(i).to(device=dev, dtype=torch.float64)[:rows] - base for i in range(len(job.fts)))
        unit = max(UNIT_ROUNDOFF.get(job.final_dtype or job.out_dtype, FINEST), FINEST)
        delta, gamma = calibrate(merged[:rows].to(dev) - base, deltas, self.alpha, unit)
        out = base.add_(delta)
        if not bool(torch.isfinite(out).all()):
            raise InputError(
                f"tensor {job.name!r}: the calibrated update overflows float64; {strength_hint(out.dtype)}"
            )
        rec["svc"] = {
            "gamma_min": float(f"{float(gamma.min()):.6g}"),
            "gamma_max": float(f"{float(gamma.max()):.6g}"),
        }
        yield cast_out(out.cpu(), job.out_dtype, job.name)
        if rows < job.shape[0]:  # rows a resized vocabulary added: the merge's values
            yield cast_out(merged[rows:], job.out_dtype, job.name)


def wrap(inner: Callable[[torch.device], TensorOp], alpha: float, is_matrix: Callable[[TensorJob], bool]):
    """``make_op`` for the runner: the merge's operation calibrated by SVC."""
    return lambda device: CalibratedOp(inner(device), alpha, is_matrix, device)


def summary(records: list[dict]) -> dict:
    """The report's ``svc`` totals: matrices calibrated and the range of γ."""
    done = [r["svc"] for r in records if "svc" in r]
    out: dict = {"calibrated_matrices": len(done)}
    if done:
        out["gamma_min"] = min(d["gamma_min"] for d in done)
        out["gamma_max"] = max(d["gamma_max"] for d in done)
    return out
