"""The one file-access layer: every input file the tool reads is opened here.

A file is read only when

- its real path (every symlink resolved) lies inside one of the *roots* it may come from: the
  input directory, or for a Hugging Face cache snapshot (``…/snapshots/<rev>``, whose files are
  symlinks into ``../../blobs``) the snapshot and the cache's blob store. A downloaded
  checkpoint whose ``tokenizer.json`` links to ``/proc/self/environ``, ``/etc/shadow`` or a file
  in a sibling directory is refused, so nothing outside the input can reach OUT. Files the user
  names directly (``--calib``, a results file, a recipe) have no root: the user chose them;
- it is a **regular file**: FIFOs, devices, sockets and directories are refused before they are
  opened (``stat``), and the open itself uses ``O_NONBLOCK | O_NOFOLLOW`` and re-checks the
  descriptor (``fstat``, same inode as the path), so a FIFO swapped in between cannot block and
  a device cannot be read;
* its size is within the limit of its kind (JSON side files, configs, indexes, recipes,
  results): larger is an error naming the file and the limit, never a silent truncation.

Every refusal is a one-line :class:`InputError` (exit 2) naming the file and why. Side files
that are only copied (tokenizer, chat template) have no size limit: they are copied in full.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

from dghard_cli.errors import InputError, RuntimeFailure
from dghard_cli.io import limits

#: Size limits per kind of file (bytes).
INDEX_LIMIT = 64 * 1024 * 1024
CONFIG_LIMIT = 16 * 1024 * 1024
JSON_LIMIT = 64 * 1024 * 1024
RESULTS_LIMIT = 64 * 1024 * 1024
REPORT_LIMIT = 256 * 1024 * 1024

_FLAGS = (
    os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
)


def _describe_mode(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISLNK(mode):
        return "a symlink"
    return "not a regular file"


def _size_text(n: int) -> str:
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20} MiB"
    return f"{n} bytes"


def is_within(path: str | Path, root: str | Path) -> bool:
    """True when ``path`` is ``root`` or lies below it (both already resolved)."""
    p, r = str(path), str(root).rstrip(os.sep) or os.sep
    return p == r or p.startswith(r if r.endswith(os.sep) else r + os.sep)


def realpath(path: str | Path) -> Path:
    """Every symlink resolved (a missing tail is kept as written); InputError if it cannot be."""
    try:
        return Path(os.path.realpath(os.fspath(path)))
    except (OSError, ValueError) as exc:
        raise InputError(f"{str(path)[:200]}: cannot be looked up ({exc})") from None


def input_roots(directory: str | Path) -> tuple[Path, ...]:
    """Where the files of an input directory may resolve to.

    The directory itself; for a Hugging Face cache snapshot (``…/snapshots/<rev>`` beside a
    ``blobs`` directory) also the cache's blob store, which its files link into.
    """
    real = realpath(directory)
    if real.parent.name == "snapshots":
        blobs = real.parent.parent / "blobs"
        if os.path.isdir(blobs):
            return (real, realpath(blobs))
    return (real,)


def _lstat(path: Path, what: str) -> os.stat_result:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        raise InputError(f"{path}: {what} is missing") from None
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise InputError(f"{str(path)[:200]}: cannot be looked up ({reason})") from None


def check_input_file(path: str | Path, *, what: str, roots: Sequence[Path] | None = None) -> os.stat_result:
    """Check without opening: inside its roots, a regular file. Returns its ``stat``."""
    p = Path(path)
    lst = _lstat(p, what)
    real = realpath(p)
    if roots is not None and not any(is_within(real, r) for r in roots):
        how = "is a symlink that resolves" if stat.S_ISLNK(lst.st_mode) else "resolves"
        raise InputError(
            f"{p}: {what} {how} outside the input directory ({real}); refusing to read it "
            "(copy the file into the directory if it belongs there)"
        )
    try:
        st = os.stat(real)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InputError(f"{p}: {what} is a symlink loop; refusing to read it") from None
        if isinstance(exc, FileNotFoundError):
            raise InputError(f"{p}: {what} is a broken symlink (to {real})") from None
        raise read_error(p, what, exc) from None
    if not stat.S_ISREG(st.st_mode):
        raise InputError(
            f"{p}: {what} is {_describe_mode(st.st_mode)}, not a regular file; refusing to read it"
        )
    return st


class InputFile:
    """A validated, open input file (a regular file, inside its roots)."""

    def __init__(self, path: Path, real: Path, fd: int, size: int, what: str) -> None:
        self.path, self.real, self.fd, self.size, self.what = path, real, fd, size, what

    def read(self, n: int) -> bytes:
        """Up to ``n`` bytes from the current position (fewer only at the end of the file)."""
        chunks, left = [], n
        while left > 0:
            b = os.read(self.fd, min(left, 16 * 1024 * 1024))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        return b"".join(chunks)

    def detach(self) -> int:
        fd, self.fd = self.fd, -1
        return fd

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> InputFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_input(
    path: str | Path, *, what: str, roots: Sequence[Path] | None = None, limit: int | None = None
) -> InputFile:
    """Open an input file for reading after the checks of this module; InputError otherwise."""
    p = Path(path)
    st = check_input_file(p, what=what, roots=roots)
    real = realpath(p)
    try:
        fd = os.open(real, _FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InputError(
                f"{p}: {what} was replaced by a symlink while opening; refusing to read it"
            ) from None
        raise read_error(p, what, exc) from None
    try:
        fst = os.fstat(fd)
        if not stat.S_ISREG(fst.st_mode) or (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
            raise InputError(f"{p}: {what} changed while it was opened; refusing to read it")
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~getattr(os, "O_NONBLOCK", 0))
        if limit is not None and fst.st_size > limit:
            raise InputError(
                f"{p}: {what} is {fst.st_size} bytes, larger than the {_size_text(limit)} limit for it"
            )
    except BaseException:
        os.close(fd)
        raise
    return InputFile(p, real, fd, fst.st_size, what)


def read_bytes(path: str | Path, *, what: str, limit: int, roots: Sequence[Path] | None = None) -> bytes:
    """The whole file (at most ``limit`` bytes, or an InputError)."""
    with open_input(path, what=what, roots=roots, limit=limit) as f:
        try:
            data = f.read(limit + 1)
        except OSError as exc:
            raise read_error(path, what, exc) from None
    if len(data) > limit:
        raise InputError(f"{path}: {what} grew past the {_size_text(limit)} limit while being read")
    return data


def read_text(path: str | Path, *, what: str, limit: int, roots: Sequence[Path] | None = None) -> str:
    """The whole file as UTF-8 text."""
    data = read_bytes(path, what=what, limit=limit, roots=roots)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: {what} is not UTF-8 text ({exc})") from None


def read_json(
    path: str | Path,
    *,
    what: str,
    limit: int = JSON_LIMIT,
    roots: Sequence[Path] | None = None,
    max_depth: int = limits.MAX_DEPTH,
    max_elements: int = limits.MAX_JSON_ELEMENTS,
) -> object:
    """A JSON file, size-, depth- and element-limited."""
    data = read_bytes(path, what=what, limit=limit, roots=roots)
    return limits.parse_json(data, f"{path}: {what}", max_depth=max_depth, max_elements=max_elements)


#: errno values that say the system, not the file, is the problem: out of descriptors, memory,
#: disk, or an I/O fault. Such a failure is a runtime failure (exit 3, resumable), never a bad input.
RESOURCE_ERRNOS = frozenset(
    getattr(errno, n)
    for n in ("EMFILE", "ENFILE", "ENOMEM", "ENOSPC", "EDQUOT", "EIO", "ENOBUFS")
    if hasattr(errno, n)
)


def read_error(path: str | Path, what: str, exc: OSError) -> InputError | RuntimeFailure:
    """The error for an OSError while opening or reading an input: InputError naming the file,
    or RuntimeFailure when the system ran out of a resource (too many open files, memory, disk)."""
    if exc.errno in RESOURCE_ERRNOS:
        hint = (
            " (raise the limit with `ulimit -n`, or merge fewer models)"
            if exc.errno in (errno.EMFILE, errno.ENFILE)
            else ""
        )
        return RuntimeFailure(
            f"{path}: the system ran out of resources while opening {what} ({exc.strerror}){hint}; "
            "the input itself is not at fault"
        )
    return InputError(f"{path}: cannot read {what} ({exc.strerror})")


def write_error(
    path: str | Path, what: str, exc: OSError, kept_in: str | Path | None = None
) -> RuntimeFailure:
    """The one error for an OSError while writing an output file (a side file, the index, the
    model card, a report): always a runtime failure (exit 3), since the inputs are not at fault;
    disk full (ENOSPC, EDQUOT) is named as such. ``kept_in``: the staging directory the rerun
    resumes from."""
    if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        cause = "disk full"
    elif exc.errno in RESOURCE_ERRNOS:
        cause = "the system ran out of resources"
    elif exc.errno == errno.EFBIG:
        cause = "the file size limit was reached"
    else:
        cause = "I/O error"
    kept = f"; finished work is kept in {kept_in}" if kept_in is not None else ""
    return RuntimeFailure(
        f"{cause} while writing {what} ({path}: {exc.strerror or exc}){kept}",
        hint="free space (or fix the cause) and run the same command again (--resume)",
    )


def copy_input(path: str | Path, dest: Path, *, what: str, roots: Sequence[Path] | None = None) -> int:
    """Copy an input file in full (any size) to ``dest`` (created; must not exist); its size.

    The input is checked and opened as every input is; ``OSError`` while writing (disk full)
    propagates for the caller to report as a runtime failure.
    """
    with open_input(path, what=what, roots=roots) as f:
        done = 0
        with open(dest, "xb") as out:
            while True:
                try:
                    block = os.read(f.fd, 8 * 1024 * 1024)
                except OSError as exc:
                    raise read_error(path, what, exc) from None
                if not block:
                    break
                out.write(block)
                done += len(block)
        return done


def walk_files(directory: Path, *, limit: int = 100_000) -> Iterator[Path]:
    """Files below ``directory``, without following symlinked directories (no loops)."""
    count = 0
    for dirpath, dirnames, filenames in os.walk(directory, followlinks=False):
        dirnames.sort()
        for name in sorted(filenames):
            count += 1
            if count > limit:
                raise InputError(f"{directory}: more than {limit} files below it; pass the file itself")
            yield Path(dirpath) / name
