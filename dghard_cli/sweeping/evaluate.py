"""Running the user's evaluation command for ``dghard sweep`` and finding what it wrote.

The template is run by the shell (``/bin/sh -c``) exactly as written, with ``{model}`` and
``{output}`` replaced by shell-quoted paths (so a path with spaces or quotes stays one word;
do not put quotes around the placeholders yourself); ``{device}`` by the device the evaluation
was given (``--devices``; ``CUDA_VISIBLE_DEVICES`` is set to it too). The command also sees
``DGHARD_MODEL``, ``DGHARD_OUTPUT``, ``DGHARD_CANDIDATE`` (and ``DGHARD_DEVICE``) in its
environment. It runs in its own process
group, with stdin closed and stdout/stderr captured to files; on ``--eval-timeout`` or an
interruption the whole group is terminated (then killed).

``{output}`` is a path that does not exist yet: the command writes a JSON file there, or
creates a directory there holding an lm-evaluation-harness ``results*.json`` (or exactly one
``.json`` file). A template without ``{output}`` must print the results JSON on stdout.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from dghard_cli.errors import InputError
from dghard_cli.io.files import RESULTS_LIMIT, read_bytes, walk_files
from dghard_cli.sweeping import reaper
from dghard_cli.sweeping.command import build_command

#: How much of the command's output the report keeps per evaluation.
LOG_TAIL_LINES = 20
LOG_TAIL_CHARS = 2000
#: Grace period between SIGTERM and SIGKILL of a timed-out command's process group.
KILL_GRACE_S = 5.0
#: How long processes an evaluation left running after it exited get to end on SIGTERM.
LEFTOVER_GRACE_S = 2.0


def check_template(template: str) -> None:
    """InputError (exit 2) for a template the sweep cannot use."""
    if not isinstance(template, str) or not template.strip():
        raise InputError("--eval: empty evaluation command; e.g. --eval './my_eval.sh {model} {output}'")
    if "{model}" not in template:
        raise InputError(
            f"--eval {template!r} has no {{model}} placeholder: the command must be told which "
            "checkpoint to evaluate, e.g. --eval './my_eval.sh {model} {output}'"
        )


def fill_template(template: str, model: Path, output: Path, device: str = "") -> str:
    """The shell command: each placeholder replaced once by a shell-quoted value
    (:mod:`dghard_cli.sweeping.command`: built from the template's tokens, never re-scanned)."""
    return build_command(template, model=str(model), output=str(output), device=device)


#: The process groups of the evaluations running now (several with ``--jobs``), so that an
#: interrupted sweep can take every one of them down from its main thread.
_RUNNING: set[subprocess.Popen] = set()
_RUNNING_LOCK = threading.Lock()
#: Set by :func:`terminate_running`: every thread waiting on an evaluation kills its group
#: (SIGTERM, then SIGKILL after the grace period) and raises :class:`EvaluationCancelled`.
_CANCEL = threading.Event()
#: The evaluations :func:`terminate_running` has sent their SIGTERM.
_SIGNALLED: set[subprocess.Popen] = set()


class EvaluationCancelled(Exception):
    """The sweep was interrupted while this evaluation ran (its process group is gone)."""


def allow_evaluations() -> None:
    """Clear a previous cancellation (a new sweep in the same process)."""
    _CANCEL.clear()
    with _RUNNING_LOCK:
        _SIGNALLED.clear()


def interrupted() -> bool:
    """Whether the evaluations of this process are being taken down (an interruption)."""
    return _CANCEL.is_set()


def terminate_running(wait: float | None = None) -> int:
    """Take down every evaluation running in this process: SIGTERM to each process group now,
    and the threads waiting on them kill what is left after the grace period. ``wait``: also
    wait up to that many seconds for the groups to be gone. Returns how many there were."""
    _CANCEL.set()
    with _RUNNING_LOCK:
        procs = list(_RUNNING)
        _SIGNALLED.update(procs)  # one SIGTERM each: a second one means "force quit" to many tools
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
    if wait:
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            with _RUNNING_LOCK:
                if not _RUNNING:
                    break
            time.sleep(0.05)
    return len(procs)


@dataclass
class EvalRun:
    """What one run of the evaluation command did."""

    status: str  # "ok" | "failed" | "timeout"
    returncode: int | None
    seconds: float
    message: str | None
    log_tail: str | None
    stdout: Path
    stderr: Path
    #: the command exited leaving processes running (they were ended)
    leftovers: bool = False


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            data = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    lines = [ln.rstrip() for ln in data.splitlines() if ln.strip()]
    text = "\n".join(lines[-LOG_TAIL_LINES:])
    return text[-LOG_TAIL_CHARS:]


def _kill_group(proc: subprocess.Popen) -> None:
    """Terminate the command's process group (it leads its own session), then kill what is left.
    The reaper at its head ends the command's descendants outside the group meanwhile."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=KILL_GRACE_S)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # children that outlived their leader, too
    proc.wait()


#: The script every evaluation command runs under (see its docstring).
REAPER = Path(__file__).with_name("reaper.py")


def _reaped(status: Path) -> bool:
    """Whether the reaper ended processes the command left running (outside its group too)."""
    try:
        doc = json.loads(status.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and isinstance(doc.get("leftovers"), int) and doc["leftovers"] > 0


def subreaper_available() -> bool:
    """Whether the reaper can adopt what the command starts outside its process group (Linux)."""
    return sys.platform.startswith("linux") and os.path.isdir("/proc")


def _end_leftovers(proc: subprocess.Popen) -> bool:
    """After the command's own process has exited: end what it started and left running in its
    process group (a server, an uploader), SIGTERM then SIGKILL after a short grace, so nothing
    can write into the candidate after the integrity check or into OUT after the move. Returns
    whether there was anything to end. A child that left the group (``setsid``, a double fork)
    was ended by the reaper already, where the platform has a subreaper (Linux); elsewhere it
    escapes, and the candidate's integrity check and the winner's re-hash before the move still
    see what it wrote until then.)"""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return False
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except (ProcessLookupError, PermissionError):
            return True
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    return True


#: The longest the reaper takes to end the command and its descendants once it is stopped
#: (it gives up on those it cannot end after that), with a second of slack.
REAPER_GIVE_UP_S = reaper.GRACE_S + reaper.GIVE_UP_S + 1.0


def _command_rc(status: Path | None) -> int | None:
    """The command's exit status when the reaper reports that the command exited on its own
    (before any stop reached it, or with status 0 after it): an interruption then keeps the
    evaluation's result. None: no such report (the command was stopped, or is still running)."""
    if status is None:
        return None
    try:
        doc = json.loads(status.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    rc = doc.get("command_rc") if isinstance(doc, dict) else None
    return rc if isinstance(rc, int) and not isinstance(rc, bool) else None


def _wait(proc: subprocess.Popen, timeout: float | None, status: Path | None = None) -> int:
    """``proc.wait(timeout)`` in short steps, so that an interruption delivered between Python
    bytecodes (Ray's cancel of a task) or :func:`terminate_running` reaches this thread within a
    fraction of a second; an evaluation the interruption killed raises EvaluationCancelled (it
    is no result, so it is not cached)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if _CANCEL.is_set():
            # the group has its SIGTERM (terminate_running): the reaper at its head ends the
            # command and what it started, then reports whether the command exited on its own
            # first. That is the verdict, not the moment the interruption was seen: a command
            # that was exiting 0 when it came is a result (it was discarded, and the resumed
            # sweep evaluated it again: the flake seen on a loaded machine)
            with _RUNNING_LOCK:
                signalled = proc in _SIGNALLED
            if not signalled:  # started as the interruption came: terminate_running missed it
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=KILL_GRACE_S + REAPER_GIVE_UP_S)
                rc = _command_rc(status)
                if rc is not None:
                    return rc
            raise EvaluationCancelled("the sweep was interrupted")
        step = 0.25 if deadline is None else min(0.25, max(0.0, deadline - time.monotonic()))
        try:
            rc = proc.wait(timeout=step)
        except subprocess.TimeoutExpired:
            if deadline is not None and time.monotonic() >= deadline:
                raise
            continue
        if rc != 0 and _CANCEL.is_set() and _command_rc(status) is None:  # killed by the interruption
            raise EvaluationCancelled("the sweep was interrupted")
        return rc


def run_command(
    template: str,
    model: Path,
    output: Path,
    logs: Path,
    *,
    timeout: float | None,
    label: str,
    device: str = "",
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> EvalRun:
    """Run the evaluation of ``model``; ``logs`` is a directory for its stdout and stderr.
    ``device`` replaces ``{device}``; ``env`` is added to this process's environment; ``cwd``:
    where the command runs (default: here)."""
    logs.mkdir(parents=True, exist_ok=True)
    out_log, err_log = logs / "stdout.log", logs / "stderr.log"
    cmd = fill_template(template, model, output, device)
    env = {**os.environ, **(env or {})}
    env.update({"DGHARD_MODEL": str(model), "DGHARD_OUTPUT": str(output), "DGHARD_CANDIDATE": label})
    if device:
        env["DGHARD_DEVICE"] = device
    status = logs / "reaper.json"
    status.unlink(missing_ok=True)
    t0 = time.perf_counter()
    with open(out_log, "wb") as so, open(err_log, "wb") as se:
        # the command runs under the reaper (its own interpreter, standard library only), which
        # ends every descendant when it exits, setsid'd daemons included (Linux)
        proc = subprocess.Popen(
            [sys.executable, "-I", str(REAPER), str(status), cmd],
            stdin=subprocess.DEVNULL,
            stdout=so,
            stderr=se,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        with _RUNNING_LOCK:
            _RUNNING.add(proc)
        try:
            rc = _wait(proc, timeout, status)
            leftovers = _end_leftovers(proc) | _reaped(status)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            secs = time.perf_counter() - t0
            return EvalRun(
                "timeout",
                None,
                secs,
                f"evaluation timed out after {timeout:g} s (--eval-timeout); its processes were killed",
                _tail(err_log) or _tail(out_log),
                out_log,
                err_log,
            )
        except BaseException:  # interrupted: take the evaluation down with us
            _kill_group(proc)
            raise
        finally:
            with _RUNNING_LOCK:
                _RUNNING.discard(proc)
                _SIGNALLED.discard(proc)
    secs = time.perf_counter() - t0
    if rc != 0:
        tail = _tail(err_log) or _tail(out_log)
        last = tail.splitlines()[-1] if tail else "no output"
        how = f"was killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
        return EvalRun("failed", rc, secs, f"evaluation command {how}: {last}", tail, out_log, err_log)
    return EvalRun("ok", 0, secs, None, None, out_log, err_log, leftovers)


def locate_results(output: Path, stdout: Path, *, uses_output: bool) -> Path:
    """The results file the command produced; InputError (the candidate is unreadable) if none."""
    from dghard_cli.scoring.results import find_results_file

    if output.is_file():
        return output
    if output.is_dir():
        found = [p for p in walk_files(output) if p.name.startswith("results") and p.name.endswith(".json")]
        if found:
            return find_results_file(output)
        any_json = sorted(p for p in walk_files(output) if p.name.endswith(".json") and p.is_file())
        if len(any_json) == 1:
            return any_json[0]
        if not any_json:
            raise InputError(f"the evaluation wrote no JSON file into {{output}} ({output})")
        raise InputError(
            f"the evaluation wrote {len(any_json)} JSON files into {{output}} and none is named "
            "results*.json; write one results file"
        )
    if not uses_output:
        text = (
            read_bytes(stdout, what="the evaluation's stdout", limit=RESULTS_LIMIT)
            .decode("utf-8", "replace")
            .strip()
            if stdout.exists()
            else ""
        )
        if not text:
            raise InputError(
                "the evaluation printed nothing on stdout (a template without {output} must print the results JSON)"
            )
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text + "\n", encoding="utf-8")
        return output
    raise InputError(f"the evaluation exited 0 but wrote nothing at {{output}} ({output})")
