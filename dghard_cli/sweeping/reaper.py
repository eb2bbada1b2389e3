"""Run one evaluation command so that nothing it starts outlives it.

    python reaper.py STATUS_FILE COMMAND

The sweep starts this script (by path, standard library only: no package import, no torch)
instead of the shell command itself. On Linux it makes itself a *child subreaper*
(``prctl(PR_SET_CHILD_SUBREAPER)``): every process the command starts, and every process those
start, is re-parented to it when its own parent exits, ``setsid`` and double forks included,
instead of to init. When the command exits, or when this script is asked to stop (SIGTERM,
SIGINT, SIGHUP: the sweep's timeout or Ctrl-C), it ends every descendant (SIGTERM, then SIGKILL
after a grace period), reaps them, writes ``{"leftovers": N}`` to STATUS_FILE and exits with the
command's status (a command killed by a signal is reported by the same signal).

An evaluation that double-forked a daemon (as servers and uploaders do) left it running after
dghard exited; it rewrote a shard of OUT. Where the subreaper is not available (not Linux, or no
/proc), the sweep ends the command's process group only: a process that left it escapes.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
#: Seconds descendants get between SIGTERM and SIGKILL.
GRACE_S = 2.0


def become_subreaper() -> bool:
    """Whether this process now adopts its orphaned descendants (Linux ≥ 3.4)."""
    if not sys.platform.startswith("linux") or not os.path.isdir("/proc"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _parents() -> dict[int, int]:
    """pid -> parent pid of every live (not zombie) process, from /proc."""
    out: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read().decode("ascii", "replace")
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses; split after the last ")"
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 2 and fields[0] not in ("Z", "X"):
            out[int(name)] = int(fields[1])
    return out


def descendants(root: int) -> list[int]:
    """Every live process below ``root``."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _parents().items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


#: Seconds past the grace period after which the reaper stops waiting for descendants it
#: cannot end (one it may not signal, one in uninterruptible sleep): it reports them instead.
GIVE_UP_S = 5.0


def end_descendants(grace: float = GRACE_S) -> int:
    """SIGTERM to every descendant, SIGKILL to those left after ``grace`` seconds (and to any
    started meanwhile), each reaped; after ``grace + GIVE_UP_S`` it stops waiting. Returns how
    many there were."""
    me = os.getpid()
    seen: set[int] = set()
    start = time.monotonic()
    deadline, give_up = start + grace, start + grace + GIVE_UP_S
    sig = signal.SIGTERM
    quiet = 0
    while True:
        _reap()
        left = descendants(me)
        if time.monotonic() >= give_up:
            return len(seen)
        if not left:
            # a scan of /proc can miss a process whose parent exits mid-scan (its chain to us is
            # broken until the kernel re-parents it to us): done after two empty scans in a row
            quiet += 1
            if quiet >= 2:
                return len(seen)
            time.sleep(0.05)
            continue
        quiet = 0
        seen.update(left)
        if time.monotonic() >= deadline:
            sig = signal.SIGKILL
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        time.sleep(0.05)


def _status(path: str, doc: dict) -> None:
    """Write ``doc`` to ``path`` whole (a reader never sees half of it)."""
    tmp = f"{path}.tmp"
    with contextlib.suppress(OSError):
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(doc, fh)
        os.replace(tmp, path)


def main(argv: list[str]) -> int:
    status_file, command = argv[1], argv[2]
    subreaper = become_subreaper()
    stopping: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        stopping.append(signum)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, stop)
    proc = subprocess.Popen(command, shell=True, stdin=subprocess.DEVNULL)
    while True:
        try:
            rc = proc.wait(timeout=0.1)
            break
        except subprocess.TimeoutExpired:
            if stopping:
                end_descendants()
    # stopped: a stop came and the command did not succeed (a success is its own result even
    # when a stop reached this script just after it, before the exit was seen)
    stopped_before = bool(stopping) and rc != 0
    # a command that exited on its own is reported first: a sweep interrupted during the clean-up
    # below keeps its result (it waits for this script instead of discarding the evaluation);
    # one ended by a stop has no result of its own
    done = {"stopped": True} if stopped_before else {"command_rc": rc}
    _status(status_file, {**done, "subreaper": subreaper})
    leftovers = end_descendants() if subreaper else 0
    _status(status_file, {**done, "leftovers": leftovers, "subreaper": subreaper})
    if stopped_before:
        rc = -stopping[0]
    if rc < 0:  # the command died of a signal: die of the same one, so the sweep reports it
        signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv))
