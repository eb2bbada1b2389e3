"""Memory the process really has, and what running out of it looks like (no torch imported).

Physical RAM is not what a process may allocate in a container or under a batch scheduler: an
address-space limit (``ulimit -v``, RLIMIT_AS), a data-segment limit (``ulimit -d``,
RLIMIT_DATA) or the memory limit of the process's cgroup (v2 ``memory.max``, v1
``memory.limit_in_bytes``, of its own cgroup and every ancestor) stops it long before. The
checks made before anything is written (:mod:`dghard_cli.engine.working_memory`) compare a
tensor's working set with :func:`process_budget`, the smallest of them, and name the limit that
bites, so a job that cannot fit is one line and exit 2 instead of an allocation failure
mid-run.

An allocation that fails anyway (the estimate is a screen, not a guarantee: the process's own
use and the row blocks come on top) must be the documented out-of-memory exit (3, finished
shards kept, resumable), but torch does not raise MemoryError for it: the CPU allocator raises
RuntimeError("… DefaultCPUAllocator: can't allocate memory …") and CUDA
``torch.cuda.OutOfMemoryError`` (a RuntimeError too). :func:`is_out_of_memory` recognises all
of them, without importing torch, so the command line's last resort can use it.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

try:
    import resource
except ImportError:  # pragma: no cover - not POSIX
    resource = None  # type: ignore[assignment]

#: Where the process's cgroup membership and mounts are read (a test points it elsewhere).
PROC_SELF = Path("/proc/self")
#: A cgroup limit at or above this is "no limit" (cgroup v1 writes 2⁶³ − 4096 for none).
NO_LIMIT = 1 << 62

PHYSICAL = "physical memory"
RLIMIT_AS = "RLIMIT_AS"
RLIMIT_DATA = "RLIMIT_DATA"
CGROUP_V2 = "memory.max"
CGROUP_V1 = "memory.limit_in_bytes"

#: How the limit that bites is named to the user, and what lifts it.
_SOURCES = {
    RLIMIT_AS: ("RLIMIT_AS, ulimit -v", "raise the address-space limit (ulimit -v)"),
    RLIMIT_DATA: ("RLIMIT_DATA, ulimit -d", "raise the data-segment limit (ulimit -d)"),
    CGROUP_V2: ("its cgroup's memory.max", "raise the container's or job's memory limit"),
    CGROUP_V1: ("its cgroup's memory.limit_in_bytes", "raise the container's or job's memory limit"),
}

#: What torch's allocators say when they cannot allocate without raising MemoryError: the CPU
#: allocator (c10/core/impl/alloc_cpu.cpp) and the MPS one (a RuntimeError before torch 2.5).
ALLOCATOR_MESSAGES = ("DefaultCPUAllocator: can't allocate memory", "MPS backend out of memory")


def fmt_bytes(n: float) -> str:
    """``3.0 GB``: decimal units, one decimal above a kilobyte."""
    for unit in ("bytes", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"  # pragma: no cover


@dataclass(frozen=True)
class MemoryBudget:
    """The bytes a job may use and the limit that sets them: :data:`PHYSICAL`, an rlimit, a
    cgroup file or a device (``cuda:0``)."""

    limit: int
    source: str

    def __str__(self) -> str:
        size = fmt_bytes(self.limit)
        if self.source == PHYSICAL:
            return f"this machine's {size}"
        if self.source in _SOURCES:
            return f"the {size} this process may use ({_SOURCES[self.source][0]})"
        return f"the {size} of {self.source}"

    @property
    def remedy(self) -> str:
        """What gives the job more memory, as the end of a sentence."""
        if self.source in _SOURCES:
            return _SOURCES[self.source][1]
        return "run on a machine with more memory"


def physical_memory() -> int | None:
    """Bytes of physical RAM; None when unknown."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return None


def rlimit_bytes(which: str) -> int | None:
    """The soft limit ``resource.<which>`` in bytes; None when there is none (or no such limit)."""
    res = getattr(resource, which, None) if resource is not None else None
    if res is None:
        return None
    try:
        soft, _ = resource.getrlimit(res)
    except (ValueError, OSError):  # pragma: no cover - a kernel without it
        return None
    return None if soft == resource.RLIM_INFINITY or soft < 0 else int(soft)


def _unescape(field: str) -> str:
    """A path from /proc/*/mountinfo, where space, tab, newline and backslash are octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def cgroup_mounts(mountinfo: str) -> list[tuple[int, Path, PurePosixPath]]:
    """``(version, mount point, mounted root)`` of each cgroup hierarchy that limits memory: the
    v2 unified one, and v1's with the memory controller."""
    out = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        root, point = PurePosixPath(_unescape(fields[3])), Path(_unescape(fields[4]))
        if tail[0] == "cgroup2":
            out.append((2, point, root))
        elif tail[0] == "cgroup" and "memory" in tail[2].split(","):
            out.append((1, point, root))
    return out


def own_cgroup(proc_cgroup: str, version: int) -> PurePosixPath | None:
    """This process's cgroup in the hierarchy of ``version`` (v1: the memory controller's), from
    the text of /proc/self/cgroup."""
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if (version == 2 and hid == "0" and controllers == "") or (
            version == 1 and "memory" in controllers.split(",")
        ):
            return PurePosixPath(path)
    return None


def group_dirs(point: Path, root: PurePosixPath, group: PurePosixPath) -> list[Path]:
    """The directories of ``group`` and its ancestors under the mount point (a limit anywhere
    above the process's cgroup binds it too); only the mount point when the group is outside
    what is mounted (a cgroup namespace the paths do not match)."""
    try:
        rel = group.relative_to(root)
    except ValueError:
        return [point]
    parts = [p for p in rel.parts if p not in ("", ".", "..")]
    return [point.joinpath(*parts[:k]) for k in range(len(parts), -1, -1)]


def read_limit(path: Path) -> int | None:
    """A cgroup memory limit file: bytes, None for ``max``, no limit, or no readable file."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max" or not text.isdigit():
        return None
    n = int(text)
    return None if n >= NO_LIMIT else n


def cgroup_limit(proc: Path | None = None) -> tuple[int, str] | None:
    """The smallest memory limit of this process's cgroup and its ancestors, v2 and v1, and the
    file that sets it; None when no cgroup limits it (or there are no cgroups)."""
    proc = PROC_SELF if proc is None else proc
    try:
        groups = (proc / "cgroup").read_text()
        mounts = (proc / "mountinfo").read_text()
    except OSError:
        return None
    best: tuple[int, str] | None = None
    for version, point, root in cgroup_mounts(mounts):
        group = own_cgroup(groups, version)
        if group is None:
            continue
        name = CGROUP_V2 if version == 2 else CGROUP_V1
        for d in group_dirs(point, root, group):
            n = read_limit(d / name)
            if n is not None and (best is None or n < best[0]):
                best = (n, name)
    return best


def process_budget(physical: int | None) -> MemoryBudget | None:
    """The memory this process may use: the smallest of ``physical`` (RAM), RLIMIT_AS,
    RLIMIT_DATA and its cgroup's limit; None when none of them is known."""
    known: list[tuple[int, str]] = [
        (n, s)
        for n, s in (
            (physical, PHYSICAL),
            (rlimit_bytes("RLIMIT_AS"), RLIMIT_AS),
            (rlimit_bytes("RLIMIT_DATA"), RLIMIT_DATA),
        )
        if n is not None
    ]
    cg = cgroup_limit()
    if cg is not None:
        known.append(cg)
    if not known:
        return None
    n, source = min(known, key=lambda c: c[0])  # a tie names the first: RAM before the limits
    return MemoryBudget(n, source)


def is_gpu_out_of_memory(exc: BaseException) -> bool:
    """torch's ``OutOfMemoryError`` (CUDA's, and other accelerators' since torch 2.5)."""
    torch = sys.modules.get("torch")
    cls = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
    return cls is not None and isinstance(exc, cls)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation that failed: MemoryError, torch's OutOfMemoryError, or
    the RuntimeError of torch's CPU (or MPS) allocator."""
    if isinstance(exc, MemoryError) or is_gpu_out_of_memory(exc):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in ALLOCATOR_MESSAGES)


def requested_bytes(exc: BaseException) -> int | None:
    """The size of the allocation that failed, where the allocator's message says it."""
    m = re.search(r"tried to allocate (\d+) bytes", str(exc), re.IGNORECASE)
    return int(m[1]) if m else None


def out_of_memory_message(exc: BaseException) -> str:
    """One line for a failed allocation on the CPU: what was asked for, and within which budget
    (naming the limit that bit, when one is smaller than RAM)."""
    budget = process_budget(physical_memory())
    n = requested_bytes(exc)
    asked = f"could not allocate {fmt_bytes(n)}" if n is not None else "an allocation failed"
    return f"out of memory: {asked}" + (f" within {budget}" if budget is not None else "")
