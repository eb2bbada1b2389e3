"""The layer-strength schedule applied while a tensor streams: :class:`ScheduledOp` wraps a
method's per-tensor operation (or none) and writes ``W_base + λ(ℓ)·(W_op − W_base)``.

The wrapped operation writes in float64, the schedule is applied in float64 and cast to the
output dtype once. Relies on the ops API of :mod:`dghard_cli.engine.ops` and on the λ that
:func:`dghard_cli.schedule.bind.bind` put on each job; :mod:`dghard_cli.schedule`
describes the schedule itself.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator

import torch

from dghard_cli.engine.ops import (
    JobInputs,
    OutputRangeError,
    TensorOp,
    all_finite,
    cast_out,
    element_spans,
    passthrough,
    strength_advice,
)
from dghard_cli.engine.plan import TensorJob
from dghard_cli.errors import KEEP_NONFINITE, InputError, RuntimeFailure
from dghard_cli.io.safetensors_format import FLOAT_DTYPES

#: The dtype the wrapped method writes in (the schedule is applied before the one final cast).
WIDE = "F64"
#: Row pieces of the schedule's own float64 temporaries.
CHUNK_BYTES = 32 * 1024 * 1024
# -- the wrapper ---------------------------------------------------------------------------------


def _all_finite(job: TensorJob, src: JobInputs) -> bool:
    keys = ["base", *[f"ft{i}" for i in range(len(job.fts))]]
    for key in keys:
        info = src.info(key)
        if info.dtype not in FLOAT_DTYPES:
            continue
        for span in element_spans(info.numel, info.itemsize, CHUNK_BYTES):
            t = src.flat(key, span)
            if not all_finite(t):
                return False
    return True


def _wide(block: torch.Tensor) -> torch.Tensor:
    """A block the wrapped method wrote in float64 (raw bytes when it passed one through), flat:
    blocks may be row ranges or pieces of the flattened tensor (a 1×N matrix, a long vector)."""
    if block.dtype == torch.uint8:
        block = block.contiguous().clone().view(torch.float64)
    if block.dtype != torch.float64:
        block = block.to(torch.float64)
    return block.reshape(-1)


class ScheduledOp:
    """``W_base + λ(ℓ)·(W_op − W_base)`` for every scheduled job; ``inner`` None: ``W_op = W_ft``."""

    def __init__(self, inner: TensorOp | None, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.inner = inner
        self.chunk_bytes = chunk_bytes

    def __call__(self, job: TensorJob, src: JobInputs, rec: dict) -> Iterator[torch.Tensor]:
        lam = job.strength
        if lam is None:  # not scheduled (cannot happen for a bound plan's method jobs)
            yield from (self.inner or passthrough)(job, src, rec)
            return
        if src.allow_nonfinite and not _all_finite(job, src):
            rec["action"], rec["reason"], rec["nonfinite"] = "kept-ft", "nonfinite", True
            rec.pop("layer_strength", None)
            yield from passthrough(job, src, rec)
            return
        wide_job = dataclasses.replace(job, out_dtype=WIDE, final_dtype=job.final_dtype or job.out_dtype)
        op = passthrough if (self.inner is None or job.action == "scaled") else self.inner
        scaled_rows = job.shared_rows if job.shared_rows is not None else (job.shape[0] if job.shape else 1)
        row_elems = math.prod(job.shape[1:]) if len(job.shape) >= 1 else 1
        scaled = scaled_rows * row_elems  # the scheduled elements come first in row-major order
        step = max(1, self.chunk_bytes // 8)
        e = 0
        for block in op(wide_job, src, rec):
            w = _wide(block)
            k = w.numel()
            for i in range(0, k, step):
                piece = w[i : i + step]
                e0, e1 = e + i, e + i + piece.numel()
                n_sched = max(0, min(e1, scaled) - e0)
                if n_sched:
                    b = src.flat("base", (e0, e0 + n_sched)).to(torch.float64)
                    yield self._scale(job, piece[:n_sched], b, lam)
                if n_sched < piece.numel():  # rows the fine-tune added: its values
                    yield cast_out(piece[n_sched:], job.out_dtype, job.name)
            e += k

    @staticmethod
    def _scale(job: TensorJob, w: torch.Tensor, b: torch.Tensor, lam: float) -> torch.Tensor:
        out = torch.sub(w, b).mul_(lam).add_(b)
        if not all_finite(out):
            if bool(torch.isfinite(w).all()) and bool(torch.isfinite(b).all()):
                raise OutputRangeError(
                    f"tensor {job.name!r}: layer {job.layer}'s strength {lam:g} (the layer schedule, "
                    f"--layer-strengths) takes finite values past float64's range",
                    advice=strength_advice(torch.float64),
                )
            raise InputError(
                f"tensor {job.name!r}: BASE or the fine-tune holds NaN or Inf; fix the checkpoint",
                advice=KEEP_NONFINITE,
            )
        if job.out_dtype == "F16" and float(out.abs().max()) > 65504.0:
            raise RuntimeFailure(
                f"tensor {job.name!r}: the scheduled values exceed float16's range; use --dtype bf16 or fp32"
            )
        return cast_out(out, job.out_dtype, job.name)


def wrap(inner: Callable[[torch.device], TensorOp | None]) -> Callable[[torch.device], TensorOp]:
    """``make_op`` for the runner: the method's operation (or none) under the schedule."""
    return lambda device: ScheduledOp(inner(device))
