"""One run per OUT: an exclusive lock beside OUT's staging directory.

``repair``, ``merge`` and ``sweep`` take ``.<OUT name>.dghard-lock`` (an ``flock`` on a file
beside OUT, holding the owner's pid) before they touch the staging directory, and drop it when
they finish or fail. A second run into the same OUT fails at once with a message that names the
other run (exit 3: nothing of its own was written; rerun when the other has finished), instead
of both runs writing into one staging directory and the loser failing on a file.

The lock is released by the kernel when its holder dies (``kill -9`` included), so a stale lock
file never blocks a later run. Creating the lock is the run's first write next to OUT, so a
parent directory that cannot be written is reported here, before any work (exit 2).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path

from dghard_cli.errors import InputError, RuntimeFailure
from dghard_cli.io import files

LOCK_SUFFIX = ".dghard-lock"


def lock_path(out: Path) -> Path:
    """The lock file of OUT."""
    out = Path(out).expanduser().absolute()
    return out.parent / f".{out.name}{LOCK_SUFFIX}"


class OutLock:
    """``with OutLock(out):`` — hold OUT's lock for the duration of a run."""

    def __init__(self, out: Path, *, label: str = "output") -> None:
        self.out = Path(out).expanduser().absolute()
        self.path = lock_path(self.out)
        self.label = label
        self.fd: int | None = None

    def acquire(self) -> OutLock:
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        for _ in range(20):
            if os.path.islink(self.path):
                raise InputError(
                    f"{self.label} {self.out}: the lock file {self.path} is a symbolic link "
                    f"(to {os.readlink(self.path)!r}); dghard never follows one there. Remove it and rerun"
                )
            try:
                fd = os.open(self.path, flags, 0o644)
            except OSError as exc:
                if exc.errno == errno.ELOOP:  # it became a symlink after the check above
                    raise InputError(
                        f"{self.label} {self.out}: the lock file {self.path} is a symbolic link; "
                        "dghard never follows one there. Remove it and rerun"
                    ) from None
                if exc.errno in files.RESOURCE_ERRNOS:  # disk full, no inodes: not the user's choice of OUT
                    raise files.write_error(self.path, "the lock file", exc) from None
                raise InputError(
                    f"{self.label} {self.out}: cannot create files in {self.path.parent} "
                    f"({exc.strerror or exc}); choose an OUT in a directory you can write to"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = _read_pid(fd)
                os.close(fd)
                who = f"(pid {holder}) " if holder else ""
                raise RuntimeFailure(
                    f"another dghard run {who}is writing {self.label} {self.out} (it holds {self.path}); "
                    "wait for it to finish, or choose another OUT"
                ) from None
            # the holder before us may have removed the file after we opened it: lock the live one
            try:
                same = os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
            self.fd = fd
            return self
        raise RuntimeFailure(f"{self.path}: could not take the lock (it keeps being replaced)")

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            if os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(self.fd).st_ino:
                os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = None

    def __enter__(self) -> OutLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        return int(text) if text.isdigit() else None
    except (OSError, ValueError):
        return None
