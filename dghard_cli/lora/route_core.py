"""The core-space route of an adapter output (``merge --core-space``): LoRA experts merged in
their shared core space, the result a LoRA adapter again.

Per module, each adapter's update ``Δ_i = L_i R_i`` (``L_i = s_i·B_i``, ``R_i = A_i``; embeddings
and Conv1D layers transposed) is expressed in the bases of the stacked factors,
``Δ_i = U M_i Vᵀ`` (:mod:`dghard_cli.spectral.core_space`), the method runs on the small cores
``M_i`` with a zero BASE exactly as it runs on a full tensor (its operation, its ``--lines``
strength, SVC), and the merged core ``M`` gives the factors of ``U M Vᵀ`` at its numerical rank
(capped by ``--rank``). An adapter that does not adapt the module contributes a zero core.
Nothing of the module's full size is formed or read: BASE's weight is not read at all.

:func:`core_unit` is given the run's :class:`~dghard_cli.lora.context.RouteContext`, the tensor's
job and the method's operation built for cores; it returns None for a tensor the route does not
take (the factored route computes it on the full tensors).
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import torch

from dghard_cli.architecture import POSITION_TABLE
from dghard_cli.engine.ops import JobInputs, TensorOp, base_record
from dghard_cli.engine.plan import TensorJob
from dghard_cli.engine.writer import RunOptions
from dghard_cli.errors import InputError
from dghard_cli.io.checkpoint import TensorInfo
from dghard_cli.lora.assemble import lora_factors
from dghard_cli.lora.context import RouteContext
from dghard_cli.lora.source import AdapterCheckpoint
from dghard_cli.spectral.core_space import core_factors, core_space


def _factors(ft: AdapterCheckpoint, module: str, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(L, R)`` with ``ΔW = L·R`` in the base weight's layout (float64); empty when ``ft`` does not
    adapt the module."""
    d = ft.modules.get(module)
    m, n = shape
    if d is None:
        return torch.zeros((m, 0), dtype=torch.float64), torch.zeros((0, n), dtype=torch.float64)
    b, a = d.factors()
    if d.transposed:  # ΔW = s·(B·A)ᵀ = (s·Aᵀ)·Bᵀ
        return a.T.mul(d.scaling), b.T.contiguous()
    return b.mul(d.scaling), a


def _memory_info(name: str, value: torch.Tensor) -> TensorInfo:
    return TensorInfo(
        name=name,
        dtype="F64",
        shape=tuple(value.shape),
        shard="",
        file=Path("<core space>"),
        offset=0,
        nbytes=value.numel() * 8,
    )


def core_unit(
    ctx: RouteContext, job: TensorJob, op: TensorOp, run: RunOptions, model_type: str | None
) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """One LoRA module merged in its core space: its record and factors (``A``, ``B``); None when
    the tensor is not a LoRA module's weight of some adapter, or the core-space rule
    (``ctx.core_rule``) leaves it to the full tensors."""
    if (
        ctx.core_rule is None
        or not job.runs_method
        or not job.name.endswith(".weight")
        or len(job.shape) != 2
        or POSITION_TABLE.search(job.name)  # PEFT takes no LoRA of it: written whole (factored route)
    ):
        return None
    module = job.name[: -len(".weight")]
    fts = [f for f in ctx.fts if isinstance(f, AdapterCheckpoint)]
    if not any(module in f.modules for f in fts) or not ctx.core_rule(job):
        return None
    t0 = time.perf_counter()
    shape = (int(job.shape[0]), int(job.shape[1]))
    pairs = [_factors(f, module, shape) for f in fts]
    space = core_space([p[0] for p in pairs], [p[1] for p in pairs])
    k = space.shape
    if min(k) == 0:  # every update is zero
        return None
    if min(k) < 2 and ctx.core_kind == "lossless":
        # a rank-1 total: a spectral method's matrix rule would not see a matrix in the core, so
        # the full tensors give its result (rank 1, written exactly); an elementwise method merges
        # the 1 x k core as any other
        return None
    zero = torch.zeros(k, dtype=torch.float64)
    core_job = dataclasses.replace(
        job,
        shape=k,
        out_dtype="F64",
        base=_memory_info(job.name, zero),
        fts=[_memory_info(job.name, c) for c in space.cores],
        shared_rows=None,
    )
    raw = {"base": zero.reshape(-1).view(torch.uint8)}
    raw.update({f"ft{i}": c.contiguous().reshape(-1).view(torch.uint8) for i, c in enumerate(space.cores)})
    src = JobInputs(core_job, raw, allow_nonfinite=run.allow_nonfinite)
    rec = base_record(job)
    rec["module"] = module
    parts = []
    for blk in op(core_job, src, rec):
        t = blk.view(torch.float64) if blk.dtype == torch.uint8 else blk.to(torch.float64)
        parts.append(t.reshape(-1, k[1]))
    merged = torch.cat(parts, dim=0) if parts else zero
    if merged.shape != zero.shape:
        raise RuntimeError(f"core of {job.name!r}: the method gave {tuple(merged.shape)}, not {k}")
    if not bool(torch.isfinite(merged).all()):
        raise InputError(
            f"--core-space: the merge of {module!r} is not finite (NaN/Inf in the adapters' factors or "
            "an overflow); check the adapters with `dghard audit-lora`"
        )
    fac = core_factors(space, merged, ctx.rank)
    rec["core_space"] = {"shape": list(k), "input_ranks": [int(p[0].shape[1]) for p in pairs]}
    rec["factor_route"] = "core-space"
    if fac.rank == 0:
        rec["written_as"] = "unchanged"
        rec["seconds"] = round(time.perf_counter() - t0, 6)
        return rec, {}
    if not math.isfinite(fac.fro2):
        raise InputError(f"--core-space: the update of {module!r} overflows float64")
    tensors = lora_factors(ctx, job.name, fac, rec, model_type)
    rec["seconds"] = round(time.perf_counter() - t0, 6)
    return rec, tensors
