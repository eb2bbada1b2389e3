"""Iso-C and Iso-CTS, isotropic merging (Marczak et al., "No Task Left Behind: Isotropic Model
Merging with Common and Task-Specific Subspaces", ICML 2025, arXiv 2502.04959).

Per eligible weight matrix (m × n), with T fine-tunes, Δ_i = W_i − W_base and Δ_TA = Σ_i Δ_i:

**Iso-C** (common subspace): the SVD Δ_TA = U·Σ·Vᵀ, its spectrum replaced by its mean,

    W = W_base + α·σ̄·U·Vᵀ,    σ̄ = mean of the singular values of Δ_TA.

**Iso-CTS** (common and task-specific subspaces), with s = min(m, n) and the common-space
fraction f (``--common-space-fraction``, default 0.8, the paper's and its code's):

    k_c = int(f·s);  d = round((s − k_c)/T);  k_c = s − T·d        (the task spaces divide evenly)
    U_c, Σ_c, V_c  = the top k_c singular triplets of Δ_TA
    U_i, Σ_i, V_i  = the top d singular triplets of (I − U_c·U_cᵀ)·Δ_i  (each task's directions
                     outside the common left space)
    U = [U_1 … U_T, U_c],  V = [V_1 … V_T, V_c],  σ̄ = mean of all their singular values
    W = W_base + α·σ̄·polar(U)·polar(V)ᵀ

polar(A) = P·Qᵀ from the SVD A = P·S·Qᵀ. Every other tensor (norms, biases, 1×N, matrices under
``--min-numel``) is averaged, ``W_base + α·mean_i(Δ_i)``, as in the reference code. Vocabulary
matrices are matrices like any other (``--exclude`` them to keep the first fine-tune's values).
Default α = 1 (the paper tunes α on held-out validation data; FusionBench's configurations of
both methods default to 1.0): sweep it for a given set of tasks.

Where the formulas are silent or degenerate, this is what is computed (documented in
docs/merge-methods.md and tested):

- the flat spectrum is over the numerical rank r of Δ_TA (σ̄ = the mean of its r non-zero
  singular values, U·Vᵀ over them): on a full-rank Δ_TA, as in the paper; on a rank-deficient one
  (adapters, identical fine-tunes) the extra min(m, n) − r directions of a full SVD would be an
  arbitrary null-space basis. Iso-CTS likewise keeps non-zero components only;
- round() is Python's (half to even, as the reference code); a split that would need more task
  directions than s (small f) takes d = ⌊s/T⌋; s < T or f = 1: d = 0, and Iso-CTS is Iso-C;
- one fine-tune: Iso-C/Iso-CTS of Δ alone (its flattened spectrum); all Δ_i = 0: BASE's values.

Streaming (see :mod:`dghard_cli.methods.subspace`), tall form X (N × M, M = min(m, n)):

- Iso-C: pass 1 accumulates G = SᵀS of S = Σ_i X_i; pass 2 writes W_base + S_b·K with
  K = α·V_r·diag(σ̄/σ_r)·V_rᵀ. Working set ≈ 4·8·M² bytes (G, its eigenvectors, K) plus the row
  blocks: about 26 MB for an 896-wide matrix, whatever T.
- Iso-CTS: pass 1 accumulates SᵀS and every X_iᵀX_i; for a tall matrix (m ≥ n, the common left
  space lies in the long side) pass 2 accumulates X_iᵀU_c (M × k_c each, U_c = S·V_c·Σ_c⁻¹ formed
  block by block), and the task Gram matrices follow as X_iᵀX_i − (X_iᵀU_c)(X_iᵀU_c)ᵀ; for a wide
  one they are P·X_iᵀX_i·P with P = I − V_c·V_cᵀ. Then ZᵀZ of the concatenated left basis (one
  pass) and the output pass. Working set ≈ (2T + 6)·8·M² bytes plus the row blocks: 3 fine-tunes
  of an 896-wide matrix, about 77 MB. A wide matrix (m < n) adds its T + 1 inputs read whole and
  its output.
"""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np
import torch

from dghard_cli.errors import InputError
from dghard_cli.methods import subspace_svd as svd
from dghard_cli.methods.declare import finite
from dghard_cli.methods.registry import NUMBER, BuildContext, MergeMethod, Param
from dghard_cli.methods.subspace import (
    ALPHA_SWEEP_RANGE,
    Result,
    SubspaceMergeOp,
    TallBlocks,
    _sum,
    inv_sqrt_psd,
    matrix_rule,
    merge_summary,
    polar_kernel,
    top_triplets,
)

COMMON_FRACTION = 0.8  # the paper's and its reference code's


def split(s: int, n_fts: int, fraction: float) -> tuple[int, int]:
    """(k_c, d): common directions and directions per task of Iso-CTS for min(m, n) = ``s``."""
    k_c = int(s * fraction)
    d = round((s - k_c) / n_fts)
    if d * n_fts > s:
        d = s // n_fts
    return s - d * n_fts, d


def iso_c_plan(alpha: float):
    """The Iso-C plan of one matrix (see the module docstring)."""

    def plan(blocks: TallBlocks) -> Result:
        _, g = blocks.grams(each=False, total=True)
        assert g is not None
        v, sig, amp = top_triplets(blocks.spectrum(g), blocks.small, noise=blocks.noise())
        del g
        mean = float(sig.mean()) if sig.size else 0.0
        scale = torch.as_tensor(alpha * mean / sig, dtype=torch.float64, device=blocks.device)
        kernel = scale[:, None] * v.T

        def left(xs: list[torch.Tensor]) -> torch.Tensor:
            return _sum(xs) @ v

        stats = {"sigma_mean": float(f"{mean:.10g}")}
        noise = blocks.noise()
        return Result(left, kernel, len(sig), amp, stats, lambda xs: svd.iso_c(xs, alpha, noise))

    return plan


def iso_cts_plan(fraction: float, alpha: float):
    """The Iso-CTS plan of one matrix (see the module docstring)."""

    def plan(blocks: TallBlocks) -> Result:
        n, dev = blocks.n, blocks.device
        k_c, d = split(blocks.small, n, fraction)
        gs, g_sum = blocks.grams(each=d > 0, total=True)
        assert g_sum is not None
        v_c, sig_c, amp_c = top_triplets(blocks.spectrum(g_sum), k_c, noise=blocks.noise())
        del g_sum
        inv_c = torch.as_tensor(1.0 / sig_c, dtype=torch.float64, device=dev)
        amps = [amp_c]
        ws: list[torch.Tensor] = []
        taus: list[np.ndarray] = []
        corr: list[torch.Tensor] = []  # tall: U_cᵀ·X_i·W_i, the common part of each task's left vectors
        if d > 0:
            refs = [float(torch.linalg.eigvalsh(g)[-1]) for g in gs]  # before the projection
            if blocks.tall:  # the common left space is on the long side: X_iᵀU_c, one pass
                a = [torch.zeros((blocks.small, v_c.shape[1]), dtype=torch.float64, device=dev) for _ in gs]
                for _, xs in blocks:
                    uc = (_sum(xs) @ v_c) * inv_c
                    for ai, x in zip(a, xs, strict=True):
                        ai.addmm_(x.T, uc)
                hs = [g.sub_(ai @ ai.T) for g, ai in zip(gs, a, strict=True)]
            else:  # on the short side: project the task Gram matrices
                p = torch.eye(blocks.small, dtype=torch.float64, device=dev) - v_c @ v_c.T
                hs = [p @ g @ p for g in gs]
            for i, h in enumerate(hs):
                w, tau, amp = top_triplets(
                    blocks.spectrum(h), d, reference=max(refs[i], 0.0), noise=blocks.noise([i])
                )
                ws.append(w)
                taus.append(tau)
                amps.append(amp)
                if blocks.tall:
                    corr.append(a[i].T @ w)
            del hs, gs
        inv_t = [torch.as_tensor(1.0 / t, dtype=torch.float64, device=dev) for t in taus]

        def left(xs: list[torch.Tensor]) -> torch.Tensor:
            uc = (_sum(xs) @ v_c) * inv_c
            parts = []
            for i, (x, w) in enumerate(zip(xs, ws, strict=False)):
                y = x @ w
                if blocks.tall:
                    y.sub_(uc @ corr[i])
                parts.append(y * inv_t[i])
            return torch.cat([*parts, uc], dim=1)

        v_cat = torch.cat([*ws, v_c], dim=1)
        sig_all = np.concatenate([*taus, sig_c])
        mean = float(sig_all.mean()) if sig_all.size else 0.0
        width = sig_all.size
        flat = torch.full((width,), mean, dtype=torch.float64, device=dev)
        zz = inv_sqrt_psd(blocks.left_gram(left, width))
        kernel, rank, amp_v = polar_kernel(zz, v_cat, flat, alpha)
        stats = {
            "sigma_mean": float(f"{mean:.10g}"),
            "common_rank": int(sig_c.size),
            "task_ranks": [int(t.size) for t in taus] if taus else [0] * n,
        }
        noises = [blocks.noise([i]) for i in range(n)]

        def accurate(xs: list[torch.Tensor]) -> svd.SvdResult:
            return svd.iso_cts(xs, k_c, d, alpha, blocks.noise(), noises, blocks.tall)

        return Result(left, kernel, rank, max(*amps, zz.amplification, amp_v), stats, accurate)

    return plan


# -- declared for dghard merge (see dghard_cli.methods.registry) ------------------------------------


def _check_fraction(value: Any, method: MergeMethod, n_fts: int) -> float:
    v = finite("common-space-fraction", value)
    if not 0.0 <= v <= 1.0:
        raise InputError(f"--common-space-fraction must be in [0, 1], got {v}")
    return v


def _op(rule: str):
    def make(p: dict, ctx: BuildContext):
        if rule == "iso-c":
            plan = iso_c_plan(p["alpha"])
        else:
            plan = iso_cts_plan(p["common_space_fraction"], p["alpha"])
        return SubspaceMergeOp(
            rule, plan, p["alpha"], ctx.device, matrix_rule(ctx.options.policy), ctx.block_bytes
        )

    return make


def _summary(rule: str):
    def summary(rows: list[dict], p: dict) -> dict:
        out = merge_summary(rule)(rows, p)
        means = [r["sigma_mean"] for r in rows if r.get("merge_rule") == rule]
        if means:
            out["median_sigma_mean"] = statistics.median(means)
        return out

    return summary


PARAMS = (
    Param(
        "common_space_fraction",
        NUMBER,
        "iso-cts: share of min(m, n) given to the common subspace of the summed deltas, 0..1 "
        "(default 0.8; the rest is split evenly between the fine-tunes' own directions).",
        default=COMMON_FRACTION,
        check=_check_fraction,
        flag="--common-space-fraction",
        sweep_range=(0.0, 1.0),
    ),
)
MERGE_METHODS = (
    MergeMethod(
        "iso-c",
        ("alpha",),
        _op("iso-c"),
        summary=_summary("iso-c"),
        defaults={"alpha": 1.0},
        sweep_axes=("alpha",),
        sweep_ranges={"alpha": ALPHA_SWEEP_RANGE},
        core_space="lossless",
    ),
    MergeMethod(
        "iso-cts",
        ("alpha", "common_space_fraction"),
        _op("iso-cts"),
        summary=_summary("iso-cts"),
        defaults={"alpha": 1.0},
        sweep_axes=("alpha", "common_space_fraction"),
        sweep_fixed=("alpha", "common_space_fraction"),
        sweep_ranges={"alpha": ALPHA_SWEEP_RANGE},
        core_space="cores",  # its common space is a share of the matrix's size
    ),
)
