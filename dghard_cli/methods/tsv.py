"""TSV-M, the Task Singular Vectors merge (Gargiulo et al., "Task Singular Vectors: Reducing Task
Interference in Model Merging", CVPR 2025, arXiv 2412.00081).

Per eligible weight matrix (m × n), with T fine-tunes and Δ_i = W_i − W_base:

    k      = ⌊min(m, n)/T⌋                        (``--tsv-rank K`` overrides it)
    Δ_i    ≈ U_i·Σ_i·V_iᵀ                         each task's top-k singular triplets
    U_cat  = [U_1 … U_T],   Σ_cat = diag(Σ_1 … Σ_T),   V_cat = [V_1 … V_T]
    W      = W_base + α·polar(U_cat)·Σ_cat·polar(V_cat)ᵀ

where polar(A) = P·Qᵀ from the SVD A = P·S·Qᵀ (the nearest matrix with orthonormal columns).
Every other tensor (norms, biases, 1×N, matrices under ``--min-numel``) is averaged:
``W_base + α·mean_i(Δ_i)``. Vocabulary matrices (embeddings, the output head) are matrices
like any other, as in the paper's code (every 2-D tensor); ``--exclude`` them to keep the first
fine-tune's values. Default α = 1: the paper's TSV-M uses α = 1.0 without validation (the
reference code and FusionBench default to it too).

Where the formula is silent or degenerate, this is what is computed (each documented in
docs/merge-methods.md and tested):

- a task whose Δ_i has numerical rank r_i < k contributes its r_i non-zero triplets only (a full
  SVD's remaining top-k vectors are an arbitrary basis of the null space, and would change the
  other tasks' polar factors);
- min(m, n) < T: k = 1 (⌊min(m, n)/T⌋ = 0 would drop the matrix's update); the T·k directions then
  exceed min(m, n) and the polar factors are partial isometries of rank min(m, n);
- identical fine-tunes: U_cat repeats its columns and the partial-isometry polar factor (over the
  non-zero singular values of U_cat) gives back the one task's top-k truncation: Δ* = α·[Δ]_k.
  Nearly identical ones make the orthogonalisation ill-conditioned, as in the paper: the
  record's ``error_bound`` says by how much, and past the output's resolution the matrix takes
  the accurate route (:mod:`.subspace_svd`);
- one fine-tune: k = min(m, n) and Δ* = α·Δ; all Δ_i = 0: Δ* = 0 (BASE's values).

Streaming (see :mod:`dghard_cli.methods.subspace`): pass 1 accumulates the T Gram matrices
X_iᵀX_i of the tall form (right singular vectors V_i and Σ_i from their eigendecomposition);
pass 2 accumulates ZᵀZ of the left basis Z = [X_1·V_1·Σ_1⁻¹ … X_T·V_T·Σ_T⁻¹] (= U_cat, formed
block by block, never stored); pass 3 writes W_base + Z_b·K. Working set per matrix, with
M = min(m, n) and R = Σ_i k_i (≈ M): the T Gram matrices (T·8·M² bytes), one eigendecomposition
(2·8·M²), V_cat and K (2·8·M·R), ZᵀZ (8·R²), and one set of row blocks (about the block size
of float64 in all) — ≈ (T + 5)·8·M² bytes: 3 fine-tunes of an 896-wide matrix, about 51 MB; a
wide matrix (m < n) adds its T + 1 inputs read whole and its output.
"""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np
import torch

from dghard_cli.errors import InputError
from dghard_cli.methods import subspace_svd as svd
from dghard_cli.methods.registry import INT, BuildContext, MergeMethod, Param
from dghard_cli.methods.subspace import (
    ALPHA_SWEEP_RANGE,
    Result,
    SubspaceMergeOp,
    TallBlocks,
    inv_sqrt_psd,
    matrix_rule,
    merge_summary,
    polar_kernel,
    top_triplets,
)


def per_task_rank(small: int, n_fts: int, override: int | None) -> int:
    """k: ``override`` (capped at min(m, n)), else ⌊min(m, n)/T⌋, at least 1."""
    if override is not None:
        return max(1, min(override, small))
    return max(1, small // n_fts)


def tsv_plan(override: int | None, alpha: float):
    """The TSV-M plan of one matrix (see the module docstring)."""

    def plan(blocks: TallBlocks) -> Result:
        k = per_task_rank(blocks.small, blocks.n, override)
        grams, _ = blocks.grams(each=True, total=False)
        vs: list[torch.Tensor] = []
        sigmas: list[np.ndarray] = []
        amps = [1.0]
        for i in range(blocks.n):
            v, s, amp = top_triplets(blocks.spectrum(grams.pop(0)), k, noise=blocks.noise([i]))
            vs.append(v)
            sigmas.append(s)
            amps.append(amp)
        dev = blocks.device
        inv = [torch.as_tensor(1.0 / s, dtype=torch.float64, device=dev) for s in sigmas]

        def left(xs: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat([(x @ v) * w for x, v, w in zip(xs, vs, inv, strict=True)], dim=1)

        width = sum(len(s) for s in sigmas)
        v_cat = torch.cat(vs, dim=1)
        d = torch.as_tensor(np.concatenate(sigmas), dtype=torch.float64, device=dev)
        zz = inv_sqrt_psd(blocks.left_gram(left, width))
        kernel, rank, amp_v = polar_kernel(zz, v_cat, d, alpha)
        stats = {"per_task_rank": k, "task_ranks": [len(s) for s in sigmas]}
        noises = [blocks.noise([i]) for i in range(blocks.n)]

        def accurate(xs: list[torch.Tensor]) -> svd.SvdResult:
            return svd.tsv(xs, k, alpha, noises)

        return Result(left, kernel, rank, max(*amps, zz.amplification, amp_v), stats, accurate)

    return plan


# -- declared for dghard merge (see dghard_cli.methods.registry) ------------------------------------


def _check_rank(value: Any, method: MergeMethod, n_fts: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"--tsv-rank must be a whole number >= 1, got {value!r}")
    return value


def _tsv_op(p: dict, ctx: BuildContext):
    return SubspaceMergeOp(
        "tsv",
        tsv_plan(p.get("tsv_rank"), p["alpha"]),
        p["alpha"],
        ctx.device,
        matrix_rule(ctx.options.policy),
        ctx.block_bytes,
    )


def _summary(rows: list[dict], p: dict) -> dict:
    out = merge_summary("tsv")(rows, p)
    ks = [r["per_task_rank"] for r in rows if r.get("merge_rule") == "tsv"]
    if ks:
        out["median_per_task_rank"] = statistics.median(ks)
    return out


PARAMS = (
    Param(
        "tsv_rank",
        INT,
        "tsv: singular directions kept per fine-tune and matrix (default ⌊min(m, n)/T⌋ for T fine-tunes).",
        check=_check_rank,
        flag="--tsv-rank",
        # the default (per matrix) is not a value a command line could repeat: left out, and each
        # matrix's record says the k it used (``per_task_rank``)
        describe=lambda value: {} if value is None else {"tsv_rank": value},
    ),
)
MERGE_METHODS = (
    MergeMethod(
        "tsv",
        ("alpha", "tsv_rank"),
        _tsv_op,
        summary=_summary,
        defaults={"alpha": 1.0},
        sweep_axes=("alpha",),
        sweep_fixed=("tsv_rank",),
        sweep_ranges={"alpha": ALPHA_SWEEP_RANGE},
        core_space="cores",  # each task keeps a share of the matrix's size
    ),
)
