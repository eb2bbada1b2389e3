"""Jobs for tests/test_executors.py, importable by name on Ray workers (tests/ is on their PYTHONPATH)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def run_job(job, assignment):
    kind, arg = job
    if kind == "square":
        return (arg * arg, dict(assignment))
    if kind == "timed":  # (folder, index, seconds): record start and end
        folder, index, seconds = arg
        start = time.time()
        time.sleep(seconds)
        Path(folder, f"{index}.txt").write_text(f"{start} {time.time()}")
        return index
    if kind == "boom":
        raise ValueError(f"bad candidate {arg}")
    if kind == "die_once":  # the first attempt's worker dies, the retry succeeds
        marker = Path(arg)
        if not marker.exists():
            marker.write_text(str(os.getpid()))
            os._exit(1)
        return "survived"
    if kind == "die_always":
        os._exit(1)
    if kind == "sleep_child":  # a long evaluation in its own session, killed on cancel
        # Ray's non-force cancel raises KeyboardInterrupt between bytecodes only: a blocking
        # proc.wait() would not see it, so poll.
        proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
        Path(arg).write_text(str(proc.pid))
        try:
            while proc.poll() is None:
                time.sleep(0.05)
        except KeyboardInterrupt:
            Path(arg + ".interrupted").write_text("")
            raise
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        return "finished"
    if kind == "stubborn":  # ignores the polite cancel; only the forced one stops it
        Path(arg).write_text(str(os.getpid()))
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                time.sleep(0.05)
            except KeyboardInterrupt:
                Path(arg + ".interrupted").write_text("")
        return "finished"
    if kind == "env":
        return os.environ.get("CUDA_VISIBLE_DEVICES")
    raise AssertionError(kind)


def on_error(job, exc):
    return ("error", job[0], type(exc).__name__, str(exc))
