"""The factored route of an adapter output: any method, its result factored per tensor.

Each tensor's output ``W*`` is computed by the method exactly as for a full checkpoint (float64),
``Δ* = W* − W_base`` is factored at its numerical rank (the kept rank, for DG-Hard) with a
certified range finder or the exact SVD from the float64 Gram matrix, capped by ``--rank`` (for
TIES/DARE of adapters: by default the largest input rank of the module), with the energy lost
recorded per module. A module whose factors would be larger than the matrix is written whole.
Δ* waits for the second pass in memory, or in a scratch file of the staging directory
(:class:`DeltaStore`) when it is large.

:func:`factored_units` is given everything it reads: the run's
:class:`~dghard_cli.lora.context.RouteContext` (BASE, ``--rank``, the input ranks, the factors'
dtype), the staging directory (spool and scratch files), the plan and the method's operation.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from dghard_cli.architecture import POSITION_TABLE
from dghard_cli.engine.ops import JobInputs, TensorOp, base_record, passthrough
from dghard_cli.engine.pipeline import EngineOptions
from dghard_cli.engine.plan import Plan, TensorJob
from dghard_cli.engine.writer import RunOptions
from dghard_cli.errors import InputError
from dghard_cli.io.checkpoint import FileReader
from dghard_cli.io.safetensors_format import torch_dtype
from dghard_cli.lora.assemble import lora_factors
from dghard_cli.lora.context import RouteContext
from dghard_cli.lora.route_core import core_unit
from dghard_cli.lora.writer import (
    SPOOL_PREFIX,
    AdapterStage,
)
from dghard_cli.spectral.lowrank import factorize_certified, factors_from_gram, gram_add

#: Updates larger than this (float32 bytes) wait for the factorisation's second pass on disk.
SPILL_BYTES = 64 * 1024 * 1024


_SCRATCH = itertools.count()


class DeltaStore:
    """A tensor's float32 update as it arrives in row blocks: in memory, or in a scratch file in
    the staging directory (removed when done), read back block by block."""

    def __init__(self, directory: Path, shape: tuple[int, ...], *, spill: bool) -> None:
        self.shape = shape
        self.parts: list[torch.Tensor] = []
        self.rows: list[int] = []
        self.path = Path(directory) / f"{SPOOL_PREFIX}delta-{next(_SCRATCH)}.tmp" if spill else None
        self._fh = open(self.path, "wb") if self.path is not None else None  # noqa: SIM115 - closed in close()

    def append(self, d: torch.Tensor) -> None:
        if self._fh is None:
            self.parts.append(d)
        else:
            self._fh.write(memoryview(d.contiguous().reshape(-1).numpy()).cast("B"))
            self.rows.append(int(d.shape[0]))

    def finish(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def blocks(self):
        if self.path is None:
            yield from self.parts
            return
        reader = FileReader(self.path)
        row_floats = math.prod(self.shape[1:])
        offset = 0
        try:
            for n in self.rows:
                buf = torch.empty((n, *self.shape[1:]), dtype=torch.float32)
                reader.read_into(memoryview(buf.reshape(-1).view(torch.uint8).numpy()), offset, "scratch")
                offset += n * row_floats * 4
                yield buf
        finally:
            reader.close()

    def whole(self) -> torch.Tensor:
        return torch.cat(list(self.blocks()), dim=0) if len(self.shape) >= 1 else self.parts[0]

    def close(self) -> None:
        self.finish()
        self.parts = []
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def factored_units(
    ctx: RouteContext,
    stage: AdapterStage,
    plan: Plan,
    op: TensorOp,
    device: torch.device,
    run: RunOptions,
    core_op: TensorOp | None = None,
) -> list[tuple[int, dict]]:
    """Every tensor of the plan, in order; on the CPU small ones two (or more) at a time, one
    thread each, as the streaming pipeline computes them (large ones alone, all threads).

    ``core_op`` (``--core-space``): the method's operation for the LoRA modules that
    :func:`~dghard_cli.lora.route_core.core_unit` merges in their core space."""
    model_type = (ctx.base.config() or {}).get("model_type")
    units: list[tuple[int, dict]] = []
    opts = run.engine or EngineOptions.for_device(device)
    workers = max(1, opts.compute_workers)
    threads = torch.get_num_threads()
    pool = (
        ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dghard-adapter") if workers > 1 else None
    )
    pending: deque = deque()

    def one(job: TensorJob) -> tuple[dict, dict[str, torch.Tensor]]:
        torch.set_num_threads(1)
        return _factored_unit(ctx, job, op, device, run, stage.dir, model_type, core_op)

    def flush(keep: int = 0) -> None:
        while len(pending) > keep:
            index, fut = pending.popleft()
            rec, tensors = fut.result()
            stage.put(index, tensors, rec)
            units.append((index, rec))

    try:
        for index, job in enumerate(plan.jobs):
            done = stage.resumed(index)
            if done is not None:
                flush()
                units.append((index, done))
                continue
            if job.action == "tied":
                flush()
                units.append((index, _tied_unit(stage, index, job, units)))
                continue
            if pool is not None and job.in_nbytes <= opts.parallel_bytes:
                pending.append((index, pool.submit(one, job)))
                flush(keep=workers)
                continue
            flush()
            torch.set_num_threads(threads)
            rec, tensors = _factored_unit(ctx, job, op, device, run, stage.dir, model_type, core_op)
            stage.put(index, tensors, rec)
            units.append((index, rec))
        flush()
    finally:
        for _, fut in pending:
            fut.cancel()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        torch.set_num_threads(threads)
    return units


def _factored_unit(
    ctx: RouteContext,
    job: TensorJob,
    op: TensorOp,
    device: torch.device,
    run: RunOptions,
    scratch: Path,
    model_type: str | None,
    core_op: TensorOp | None = None,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """One tensor: the method's output in float64, its update Δ* = W* − W_base, its factors.

    A tall matrix's float64 Gram is accumulated while the method's row blocks arrive and Δ*
    (float32) goes to a scratch file in the staging directory when it is large, for the second
    pass of the factorisation; W* itself is kept only for what is written whole (1-D tensors,
    updates that are not low-rank), so memory stays a few blocks plus the factors.
    """
    if core_op is not None:
        got = core_unit(ctx, job, core_op, run, model_type)
        if got is not None:
            return got
    if ctx.skip_untouched and job.untouched:
        # no adapter touches it (each fine-tune's tensor is BASE's own): every method gives BASE
        # back, so nothing is read (TIES spent 100 s on the bench's 136 M-entry embedding)
        rec = base_record(job)
        rec["module"] = job.name.rsplit(".", 1)[0] if "." in job.name else job.name
        rec["written_as"] = "unchanged"
        return rec, {}
    job64 = dataclasses.replace(job, out_dtype="F64")
    src = JobInputs(job64, None, allow_nonfinite=run.allow_nonfinite)
    rec = base_record(job)
    rec["module"] = job.name.rsplit(".", 1)[0] if "." in job.name else job.name
    t0 = time.perf_counter()
    if job.runs_method:
        blocks = op(job64, src, rec)
    else:
        blocks = passthrough(job64, src, rec, "base" if job.action == "kept-base" else "ft0")
    shape = tuple(job.shape)
    out_dt = torch_dtype(job.out_dtype)
    # a position/token-type table is an nn.Embedding that PEFT cannot take a Linear LoRA of: whole
    lora_able = len(shape) == 2 and job.name.endswith(".weight") and not POSITION_TABLE.search(job.name)
    tall = lora_able and shape[0] >= shape[1]
    value = None if lora_able else torch.empty(shape, dtype=out_dt)
    store = DeltaStore(scratch, shape, spill=tall and math.prod(shape) * 4 > SPILL_BYTES)
    nonzero, finite, r0 = False, True, 0
    try:
        for blk in blocks:
            t = blk.view(torch.float64) if blk.dtype == torch.uint8 else blk.to(torch.float64)
            if len(shape) >= 2:
                t = t.reshape(-1, *shape[1:])
                rows = (r0, r0 + t.shape[0])
                b = job.base.read(rows) if job.base is not None else None
            else:
                t = t.reshape(shape)
                rows = None
                b = job.base.read() if job.base is not None else None
            if value is not None:
                if rows is None:
                    value.copy_(t)
                else:
                    value[rows[0] : rows[1]] = t
            if b is not None:
                t.sub_(b.to(torch.float64))
            d32 = t.to(torch.float32)
            del t, b
            nonzero = nonzero or bool(torch.any(d32 != 0))
            finite = finite and bool(torch.isfinite(d32).all())
            store.append(d32)
            if rows is not None:
                r0 = rows[1]
        del blocks
        store.finish()
        if not nonzero:
            rec["written_as"] = "unchanged"
            rec["seconds"] = round(time.perf_counter() - t0, 6)
            return rec, {}
        if lora_able and finite:
            module = rec["module"]
            # --core-space leaves a tensor here only when its full-tensor merge is the one asked for:
            # exact, so no default cap
            default_cap = None if ctx.core_rule is not None else ctx.input_ranks.get(module)
            cap = ctx.rank if ctx.rank is not None else default_cap
            kept = rec.get("low_rank") if rec.get("reason") == "low-rank" else rec.get("rank_kept")
            hint = kept or cap or 16
            fac = factors(store, shape, cap, int(hint), device)
            rec["factor_route"] = fac[1]
            fac = fac[0]
            m, n = shape
            if fac.rank and (fac.rank * (m + n) < m * n or cap is not None):
                tensors = lora_factors(ctx, job.name, fac, rec, model_type)
                rec["seconds"] = round(time.perf_counter() - t0, 6)
                return rec, tensors
        if value is None:  # written whole after all: W* = W_base + Δ*, to float32 rounding of Δ*
            value = torch.empty(shape, dtype=out_dt)
            r = 0
            for d in store.blocks():
                rows = (r, r + d.shape[0])
                base = job.base.read(rows).to(torch.float64) if job.base is not None else 0.0
                value[rows[0] : rows[1]] = d.to(torch.float64) + base
                r = rows[1]
        rec["written_as"] = "full"
        rec["seconds"] = round(time.perf_counter() - t0, 6)
        return rec, {"value": value}
    finally:
        store.close()


def factors(store: DeltaStore, shape: tuple[int, int], cap: int | None, hint: int, device) -> tuple:
    """Exact factors of a stored update: the certified two-pass route when no rank limit
    applies and the update is low-rank (DG-Hard's result, adapters), else the exact SVD from
    the float64 Gram matrix (truncated to ``cap``)."""
    m, n = shape
    tall = m >= n
    if tall:
        blocks = store.blocks
    else:
        x = store.whole().T

        def blocks():
            step = max(1, (32 << 20) // max(1, 8 * m))
            return (x[r : r + step] for r in range(0, x.shape[0], step))

    tall_shape = (m, n) if tall else (n, m)
    fac = None
    if cap is None and 2 * hint + 8 < min(m, n):
        fac = factorize_certified(blocks, tall_shape, 2 * hint + 8, device=device)
    route = "range-finder-certified" if fac is not None else "gram-eigh-float64"
    if fac is None:
        g = torch.zeros((tall_shape[1], tall_shape[1]), dtype=torch.float64, device=device)
        for xb in blocks():
            gram_add(g, xb)
        fac = factors_from_gram(g, tall_shape, blocks, cap)
    if not tall:
        fac = dataclasses.replace(fac, left=fac.right.T.contiguous(), right=fac.left.T.contiguous())
    return fac, route


def _tied_unit(stage: AdapterStage, index: int, job: TensorJob, units: list[tuple[int, dict]]) -> dict:
    rec = base_record(job)
    rec["module"] = job.name.rsplit(".", 1)[0]
    src = next((r for _, r in units if r["name"] == job.tied_to), None)
    rec["written_as"] = "tied"
    if src is not None and src.get("written_as") == "full":
        raise InputError(
            f"--format peft: {job.name!r} is tied to {job.tied_to!r}, whose update is written whole "
            "(modules_to_save); PEFT cannot keep such a copy tied — write a full checkpoint"
        )
    stage.put(index, {}, rec)
    return rec
