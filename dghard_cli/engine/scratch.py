"""Work buffers reused from one block and one tensor to the next.

:mod:`dghard_cli.engine.memory` makes every large allocation its own mapping, returned to the
system when freed, so resident memory tracks the working set. The price is paid on every new
tensor: the kernel maps and zeroes it page by page on first touch. Measured on the reference
machine (one thread, 4.36 M float32 values, a 0.5B model's MLP matrix): converting bf16 to
float32 took 6.1 ms into a new tensor and 1.1 ms into a reused one; page faults were 9.2 of
task arithmetic's 15.9 CPU seconds and 22.7 of TIES' 52.8 on the 0.5B-shaped bench.

A :class:`Scratch` holds named byte buffers that grow to the largest size asked and are then
reused: the hot loops (the elementwise merges, the spectral passes) take their float copies
and temporaries from it, by slot name (one slot serves any dtype: buffers that are never live
together share a name). A tensor taken from a scratch must not outlive the block that took it
(the next ``take`` of its slot overwrites it): anything handed to the writer is a new tensor.

The pipeline gives each job a scratch of its own (:func:`using`; a worker keeps reusing one
across its jobs) and releases them before a large job and at the end; code outside a job sees
:func:`current` return None and allocates as before.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_local = threading.local()


class Scratch:
    """Named, reusable work buffers (see the module docstring)."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, str], torch.Tensor] = {}

    def take(
        self, slot: str, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device=None
    ) -> torch.Tensor:
        """A contiguous tensor of ``shape`` and ``dtype`` (contents undefined), valid until the
        next ``take`` of the same slot."""
        dev = torch.device(device if device is not None else "cpu")
        key = (slot, str(dev))
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < nbytes:
            if buf is not None:  # free the old one first: never hold both
                del self._bufs[key], buf
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=dev)
            self._bufs[key] = buf
        return buf[:nbytes].view(dtype).view(tuple(shape))

    def owns(self, t: torch.Tensor) -> bool:
        """Is ``t`` (a view of) one of these buffers? Such a tensor must be copied before it
        leaves the block (to the writer, to a caller)."""
        ptr = t.untyped_storage().data_ptr()
        return any(b.untyped_storage().data_ptr() == ptr for b in self._bufs.values())

    def nbytes(self) -> int:
        """Bytes held."""
        return sum(b.numel() for b in self._bufs.values())

    def release(self) -> None:
        """Drop every buffer (the memory returns to the system)."""
        self._bufs.clear()


def current() -> Scratch | None:
    """The scratch of the job running on this thread (None outside a job: allocate)."""
    return getattr(_local, "scratch", None)


@contextmanager
def using(scratch: Scratch) -> Iterator[Scratch]:
    """Make ``scratch`` this thread's :func:`current` for the duration."""
    before = current()
    _local.scratch = scratch
    try:
        yield scratch
    finally:
        _local.scratch = before


class ScratchPool:
    """The pipeline's scratches: one per job in flight, reused by the next job."""

    def __init__(self) -> None:
        self._free: list[Scratch] = []
        self._lock = threading.Lock()

    @contextmanager
    def job(self) -> Iterator[Scratch]:
        """A scratch for one job, :func:`current` on this thread until the job ends."""
        with self._lock:
            s = self._free.pop() if self._free else Scratch()
        try:
            with using(s):
                yield s
        finally:
            with self._lock:
                self._free.append(s)

    def release(self) -> None:
        """Drop the buffers of every scratch not in use."""
        with self._lock:
            for s in self._free:
                s.release()
            self._free.clear()
