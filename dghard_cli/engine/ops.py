"""The engine's API for per-tensor operations: what a method may use, and nothing more.

A method (``dghard_cli.methods``) is a :data:`TensorOp`: it gets a job (one output tensor of
the plan), its :class:`JobInputs` (the inputs, prefetched or read in row blocks on demand) and a
record to fill, and yields the output's blocks in order. The helpers here are the ones every
operation needs: :func:`passthrough` (an input's value, checked finite), :func:`cast_out`
(to the output dtype), :func:`row_ranges`, :func:`element_spans` and :func:`base_record`. The streaming engine
(:mod:`dghard_cli.engine.pipeline`) drives the operations; methods never import it.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator

import torch

from dghard_cli.engine.plan import TensorJob
from dghard_cli.errors import KEEP_NONFINITE, Advice, InputError
from dghard_cli.io.checkpoint import TensorInfo
from dghard_cli.io.safetensors_format import FLOAT_DTYPES, torch_dtype


class InlineReads:
    """Seconds the compute threads spent reading inputs themselves (tensors too large to
    prefetch, read in row blocks on demand): the read part of their time."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._lock = threading.Lock()

    def timed(self, read: Callable[[], torch.Tensor]) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return read()
        finally:
            dt = time.perf_counter() - t0
            with self._lock:
                self.seconds += dt


class JobInputs:
    """A job's inputs: whole tensors (prefetched, or read now) or row blocks read on demand."""

    def __init__(
        self,
        job: TensorJob,
        raw: dict[str, torch.Tensor] | None,
        *,
        allow_nonfinite: bool = False,
        pin: bool = False,
        reads: InlineReads | None = None,
    ) -> None:
        self.job = job
        self._raw = raw or {}
        self.pin = pin  # read on demand into page-locked memory (CUDA)
        #: NaN/Inf in an input: pass the fine-tune's value through (reported) instead of failing.
        self.allow_nonfinite = allow_nonfinite
        self._reads = reads

    def _read(self, read: Callable[[], torch.Tensor]) -> torch.Tensor:
        return read() if self._reads is None else self._reads.timed(read)

    def _get(self, key: str, info: TensorInfo, rows: tuple[int, int] | None) -> torch.Tensor:
        raw = self._raw.get(key)
        if raw is not None:
            t = info.decode(raw)
            return t if rows is None else t[rows[0] : rows[1]]
        return self._read(lambda: info.read(rows, pin=self.pin))

    def base(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        assert self.job.base is not None
        return self._get("base", self.job.base, rows)

    def ft(self, i: int = 0, rows: tuple[int, int] | None = None) -> torch.Tensor:
        return self._get(f"ft{i}", self.job.fts[i], rows)

    def info(self, key: str) -> TensorInfo:
        info = self.job.base if key == "base" else self.job.fts[int(key[2:])]
        assert info is not None
        return info

    def raw_span(self, key: str, span: tuple[int, int] | None) -> torch.Tensor:
        """Raw bytes of elements ``[e0, e1)`` of the flattened input (None: all of it)."""
        if span is None:
            return self.raw(key)
        info = self.info(key)
        raw = self._raw.get(key)
        if raw is None:
            return self._read(lambda: info.read_raw_span(span, pin=self.pin))
        return raw[span[0] * info.itemsize : span[1] * info.itemsize]

    def flat(self, key: str, span: tuple[int, int] | None) -> torch.Tensor:
        """Elements ``[e0, e1)`` of the flattened input, decoded (a 1-D tensor)."""
        return self.raw_span(key, span).view(torch_dtype(self.info(key).dtype))

    def raw(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Raw bytes of ``base`` or ``ft{i}`` (or of rows of it), read now if not prefetched."""
        info = self.info(key)
        raw = self._raw.get(key)
        if raw is None:
            return self._read(lambda: info.read_raw(rows, pin=self.pin))
        if rows is None:
            return raw
        return raw[rows[0] * info.row_bytes : rows[1] * info.row_bytes]


#: A per-tensor operation: yields the output's bytes in order (tensors in the output dtype,
#: whole or in row blocks), and fills ``record`` with its statistics.
TensorOp = Callable[[TensorJob, JobInputs, dict], Iterator["torch.Tensor"]]


def base_record(job: TensorJob) -> dict:
    rec: dict = {
        "name": job.name,
        "shape": list(job.shape),
        "dtype": job.out_dtype,
        "input_dtype": job.fts[0].dtype if job.fts else (job.base.dtype if job.base else None),
        "action": job.action,
        "shard": job.shard,
    }
    if job.reason:
        rec["reason"] = job.reason
    if job.tied_to:
        rec["tied_to"] = job.tied_to
    if job.shared_rows is not None:
        rec["shared_rows"] = job.shared_rows
        rec["base_rows"] = job.base.shape[0] if job.base else None
    if job.strength is not None:  # a layer-strength schedule (dghard_cli/schedule/)
        rec["layer"], rec["layer_strength"] = job.layer, job.strength
    return rec


#: The options that scale a computed update (each command names those it has).
STRENGTH_OPTIONS = ("--lambda", "--alpha", "--weights", "--lines", "--layer-strengths")
#: The next wider output dtype (its --dtype spelling); float64 has none.
_WIDER = {
    "BF16": "fp32",
    "F16": "fp32",
    "F32": "fp64",
    "bfloat16": "fp32",
    "float16": "fp32",
    "float32": "fp64",
}


def strength_advice(dtype: object) -> Advice:
    """What the user can change when computed values leave ``dtype``'s range: the strengths,
    and a wider output where one exists above ``dtype`` (the output's safetensors name or a
    torch dtype): "--dtype fp32" was advised to a float32 output."""
    wider = _WIDER.get(str(dtype).removeprefix("torch."))
    more = f", or write a wider output (--dtype {wider})" if wider else ""
    return Advice(STRENGTH_OPTIONS, "lower the strengths ({options})" + more, sep="; ")


class OutputRangeError(InputError):
    """Finite computed values that the output dtype cannot hold (they would be written as ±Inf)."""


def all_finite(t: torch.Tensor) -> bool:
    """No NaN/Inf in ``t`` (True for non-float tensors). One reduction first: a sum is finite only
    when every value is (an Inf makes it ±Inf or NaN, a NaN makes it NaN), and it costs a fiftieth
    of ``isfinite(t).all()`` on a bf16 tensor (8 ms against 360 ms for 136 M values). A sum that
    overflows from finite values is checked again value by value."""
    if not t.is_floating_point() or not t.numel():
        return True
    # float8 has no sum and no isfinite of its own on the CPU: widened first (the dtypes are
    # named here, not at import: torch is imported lazily, only when a command computes)
    if t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return bool(torch.isfinite(t.to(torch.float32)).all())
    return math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all())


def cast_out(t: torch.Tensor, out_dtype: str, name: str = "") -> torch.Tensor:
    """``t`` in the output dtype: the one place the full-checkpoint route narrows a value.

    A value that is finite before the cast and ±Inf after it (float32's 3.4e38 into float16's
    65504, or a bf16 product past its range) is never written: OutputRangeError naming the tensor
    and the options that scale it. Values that were already non-finite are the caller's concern
    (refused where they were computed, or passed through with ``--allow-nonfinite``).
    """
    target = torch_dtype(out_dtype)
    if t.dtype == target:
        return t
    out = t.to(target)
    if not all_finite(out) and all_finite(t):
        big = float(t.abs().max())
        raise OutputRangeError(
            f"tensor {name!r}: computed values reach {big:.4g}, beyond {out_dtype}'s range "
            f"({torch.finfo(target).max:.4g})",
            advice=strength_advice(out_dtype),
        )
    return out


def element_spans(numel: int, elem_bytes: int, chunk_bytes: int) -> list[tuple[int, int] | None]:
    """Spans of the flattened tensor of about ``chunk_bytes`` (at ``elem_bytes`` per element).

    Row blocks cannot split a 1×N matrix or a long vector; these can, so memory stays within
    the block size whatever the shape (None: one piece, the whole tensor).
    """
    if numel * elem_bytes <= chunk_bytes:
        return [None]
    step = max(1, chunk_bytes // max(1, elem_bytes))
    return [(e0, min(e0 + step, numel)) for e0 in range(0, numel, step)]


def passthrough(
    job: TensorJob, src: JobInputs, rec: dict, key: str = "ft0", chunk_bytes: int = 64 * 1024 * 1024
) -> Iterator[torch.Tensor]:
    """The input's value (bit-identical when the dtype is unchanged), in pieces of the
    flattened tensor (so a 1×N matrix is streamed too), each at most ``chunk_bytes`` of float64.

    On the way: non-finite values are refused (naming the tensor), and ‖FT − BASE‖_F is
    recorded when BASE has the same shape.
    """
    info = src.info(key)
    is_float = info.dtype in FLOAT_DTYPES
    base = job.base if key != "base" else None
    comparable = base is not None and base.shape == info.shape and is_float and base.dtype in FLOAT_DTYPES
    sumsq = 0.0
    for span in element_spans(info.numel, 8 if is_float else info.itemsize, chunk_bytes):
        raw = src.raw_span(key, span)
        if is_float:
            t = raw.view(torch_dtype(info.dtype))
            if not all_finite(t):
                if not src.allow_nonfinite:
                    which = "BASE" if key == "base" else "the fine-tune"
                    raise InputError(
                        f"tensor {job.name!r} in {which} ({info.file}) contains NaN or Inf; fix the checkpoint",
                        advice=KEEP_NONFINITE,
                    )
                rec["nonfinite"] = True
                comparable = False
            if comparable:
                d = t.to(torch.float64).sub_(src.flat("base", span).to(torch.float64))
                sumsq += float(torch.dot(d, d))
                del d
            yield raw if info.dtype == job.out_dtype else cast_out(t, job.out_dtype, job.name)
        else:
            yield raw
    if comparable and not rec.get("nonfinite"):
        rec["delta_norm"] = sumsq**0.5
