"""``run_dghard`` (tests/conftest.py) runs the command line in the test's interpreter: it must
give what the real process gives and leave the interpreter as it found it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
from conftest import REPO, run_dghard, run_dghard_process

from dghard_cli.cli import common


def test_the_same_exit_code_and_streams_as_the_process():
    # a usage error (click's message, the program's name) and a bad input (run_cli's one line)
    for args in (["repair"], ["score", "--base", "nope.json", "--ft", "x", "--candidate", "y"]):
        inside, process = run_dghard(*args), run_dghard_process(*args)
        assert (inside.returncode, inside.stdout, inside.stderr) == (
            process.returncode,
            process.stdout,
            process.stderr,
        ), args
    assert inside.returncode == 2 and inside.stderr.startswith("dghard: error: ")


def _state() -> tuple:
    handlers = tuple(signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM))
    return (
        os.getcwd(),
        dict(os.environ),
        sys.argv[:],
        torch.get_num_threads(),
        warnings.filters[:],
        handlers,
    )


def test_cwd_env_argv_signals_threads_and_warning_filters_are_restored(tmp_path):
    def handler(signum, frame):  # noqa: ARG001 - signal handler signature
        pass

    previous = signal.signal(signal.SIGINT, handler)  # the command installs its own, then restores
    try:
        before = _state()
        (tmp_path / "b.json").write_text('{"x": 0.5}')
        r = run_dghard(
            "score", "--base", "b.json", "--ft", "b.json", "--candidate", "b.json", "--json",
            cwd=tmp_path, env={"COLUMNS": "61", "DGHARD_TEST_VAR": "1"},
        )  # fmt: skip
        assert r.returncode == 0, r.stderr  # the relative paths were found: it ran in cwd
        assert _state() == before
        assert signal.getsignal(signal.SIGINT) is handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_an_exception_escaping_the_command_fails_the_test_and_a_hang_times_out(monkeypatch):
    def boom() -> None:
        raise RuntimeError("escaped")

    monkeypatch.setattr(common, "limit_allocator_retention", boom)
    with pytest.raises(RuntimeError, match="escaped"):
        run_dghard("score", "--help")
    monkeypatch.setattr(common, "limit_allocator_retention", lambda: time.sleep(30))
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_dghard("score", "--help", timeout=0.5)
    assert time.monotonic() - t0 < 10
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_variables_read_at_start_up_need_a_process():
    with pytest.raises(ValueError, match="HF_HUB_CACHE is read at start-up"):
        run_dghard("--version", env={"HF_HUB_CACHE": "/elsewhere"})


def test_the_suite_handles_ctrl_c_even_when_started_in_the_background():
    """A background job of a script starts with SIGINT ignored; the interruption tests simulate a
    Ctrl-C and need Python's handler (they failed with "DID NOT RAISE Interrupted" there)."""
    code = (
        "import signal, sys; sys.path.insert(0, 'tests'); import conftest; "
        "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert proc.stdout.strip() == "True", proc.stderr
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
