"""Shape products checked before any allocation: will one tensor's work fit in memory at all?

The streaming engine bounds memory by the block size for most work, but some of it is a
function of a tensor's shape, not of the blocks: the spectral methods form the float64 Gram
matrix of the smaller side (``8·min(m, n)²`` bytes, plus its eigendecomposition), read a wide
matrix whole, and TIES selects its top-k on the whole ``|Δ|``. A header may declare any shape
its file (sparse, say) backs — a 10⁶×10⁶ matrix asks for an 8 TB Gram matrix. So before the
first allocation every job's working set is estimated from its shape and a job that cannot fit
in the memory this process may use (:func:`memory_budget`: the smallest of RAM, RLIMIT_AS,
RLIMIT_DATA and the cgroup's limit; a GPU's own memory) is refused with a one-line InputError
naming the tensor and the limit that bites (exit 2), instead of an allocation failure deep
inside torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from dghard_cli.engine.memory_budget import MemoryBudget, fmt_bytes, physical_memory, process_budget
from dghard_cli.engine.plan import TensorJob
from dghard_cli.errors import InputError


def machine_memory(device: torch.device | None = None) -> int | None:
    """Bytes of memory on ``device`` (physical RAM for the CPU); None when unknown."""
    if device is not None and device.type == "cuda":
        try:
            return int(torch.cuda.get_device_properties(device).total_memory)
        except (RuntimeError, AssertionError):  # pragma: no cover - no CUDA here
            return None
    return physical_memory()


def memory_budget(device: torch.device | None = None) -> MemoryBudget | None:
    """The memory a job on ``device`` may use: a GPU's own memory, else the process's budget (the
    smallest of RAM, RLIMIT_AS, RLIMIT_DATA and the cgroup's limit); None when unknown. Every
    check before writing compares with this, so a job over a container's limit is refused in one
    line, not met by the allocator (compared with RAM alone, a 15000 × 15000 WUDI merge under
    ``ulimit -v 3000000`` started and failed in torch's allocator, exit 3 "internal error")."""
    if device is not None and device.type == "cuda":
        n = machine_memory(device)
        return MemoryBudget(n, str(device)) if n is not None else None
    return process_budget(machine_memory())


def over_budget(need: int, device: torch.device | None = None) -> MemoryBudget | None:
    """The budget ``need`` bytes exceed on ``device``; None when they fit (or it is unknown)."""
    budget = memory_budget(device)
    return budget if budget is not None and need > budget.limit else None


def spectral_bytes(rows: int, cols: int) -> int:
    """Working set of one spectral pass: the float64 Gram matrix and its eigendecomposition
    (three ``s×s`` float64 matrices, ``s = min(m, n)``), and a wide matrix read whole (base,
    fine-tune and the output, float32 or wider)."""
    s = min(rows, cols)
    gram = 3 * 8 * s * s
    wide = 3 * 4 * rows * cols if rows < cols else 0
    return gram + wide


#: Merge methods that take a spectrum of each eligible matrix (checked as ``spectral``).
SPECTRAL_MERGES = frozenset({"dg-hard", "tsv", "iso-c", "iso-cts"})


def dense_svd_bytes(rows: int, cols: int, n_fts: int) -> int:
    """Working set of a merge computed from float64 SVDs of whole matrices (STAR, CART, the SVC
    post-step, the subspace merges' accurate route): the T task vectors, their sum or
    projections, the SVD's factors and its workspace, the result: ``(2T + 6)·8·m·n`` bytes."""
    return (2 * n_fts + 6) * 8 * rows * cols


def check_dense_svd(
    jobs: Iterable[TensorJob],
    *,
    n_fts: int,
    is_matrix,
    what: str,
    device: torch.device | None = None,
    bytes_of: Callable[[int, int, int], int] = dense_svd_bytes,
    work: str = "float64 SVDs of the whole matrices",
) -> None:
    """InputError for the first matrix whose float64 work (``bytes_of(rows, cols, T)``, by default
    dense SVDs) cannot fit in memory, before anything is written (``what`` names the option that
    needs it, ``work`` what it does)."""
    budget = memory_budget(device)
    if budget is None:
        return
    for job in jobs:
        if job.runs_method and len(job.shape) == 2 and is_matrix(job):
            rows = job.shared_rows if job.shared_rows is not None else job.shape[0]
            need = bytes_of(rows, job.shape[1], n_fts)
            if need > budget.limit:
                _refuse(job, need, budget, f"for {what} ({work})")


def ties_bytes(job: TensorJob) -> int:
    """TIES' whole-tensor selection: ``|Δ|`` in the work dtype and the radix buckets beside it."""
    return 3 * 4 * math.prod(job.shape)


def check_jobs(
    jobs: Iterable[TensorJob], *, method: str, spectral: bool, device: torch.device | None = None
) -> None:
    """InputError for the first method job whose working set exceeds the memory budget."""
    budget = memory_budget(device)
    if budget is None:
        return
    limit = budget.limit
    for job in jobs:
        if not job.runs_method or len(job.shape) != 2:
            if job.runs_method and method == "ties" and ties_bytes(job) > limit:
                _refuse(job, ties_bytes(job), budget, "for TIES' top-k selection")
            continue
        rows = job.shared_rows if job.shared_rows is not None else job.shape[0]
        cols = job.shape[1]
        if spectral or method in SPECTRAL_MERGES:
            need = spectral_bytes(rows, cols)
            if need > limit:
                s = min(rows, cols)
                _refuse(job, need, budget, f"for its spectrum (the {s}×{s} float64 Gram matrix)")
        if method == "ties" and ties_bytes(job) > limit:
            _refuse(job, ties_bytes(job), budget, "for TIES' top-k selection")


def _refuse(job: TensorJob, need: int, budget: MemoryBudget, what: str) -> None:
    shape = "×".join(map(str, job.shape))
    raise InputError(
        f"tensor {job.name!r} ({shape}) needs about {fmt_bytes(need)} of memory {what}, more than "
        f"{budget}; --exclude it, or {budget.remedy}"
    )
