from __future__ import annotations

import os

# One BLAS thread pool at a time: the float64 references below use numpy (OpenBLAS), the
# package uses torch (OpenMP); both pools busy-waiting on 2 cores slow each other 50x.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# huggingface_hub reads its offline switch once, at import: set it before anything imports it, as
# the command line's subprocesses get it, so in-process runs never try the network either.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import logging
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parent.parent

# A shell starts a background job without job control (`.ci/run > log &` in a script, nohup under
# sh) with SIGINT ignored, and ignored signals are inherited: then no Ctrl-C the tests simulate
# (os.kill(SIGINT), Ray's polite cancel, which raises KeyboardInterrupt in its worker only when
# Python handles SIGINT) reaches the sweep, and the interruption tests fail ("DID NOT RAISE
# Interrupted"). Python's own handler, as in a terminal; children started from here then get
# SIGINT's default again (a handled signal is reset on exec, an ignored one is not).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


#: What click prints as the program in usage lines of ``python -m dghard_cli``.
PROG_NAME = "python -m dghard_cli"

#: The warning filters of a plain ``python`` (no -W, no PYTHONWARNINGS), which a subprocess gets.
_INTERPRETER_WARNING_FILTERS = (
    ("default", DeprecationWarning, "__main__"),
    ("ignore", DeprecationWarning, ""),
    ("ignore", PendingDeprecationWarning, ""),
    ("ignore", ImportWarning, ""),
    ("ignore", ResourceWarning, ""),
)

#: Environment variables that torch, huggingface_hub, the allocator or the interpreter read once,
#: at start-up or import: changing them for one in-process run would not do what it does in a
#: fresh process, so a test that sets them needs :func:`run_dghard_process`.
_READ_AT_START = (
    "PYTHON",
    "HF_",
    "HUGGINGFACE_",
    "TRANSFORMERS_",
    "TORCH",
    "PYTORCH_",
    "CUDA_",
    "OMP_",
    "MKL_",
    "OPENBLAS_",
    "MALLOC_",
)


class _InProcessTimeout(BaseException):
    """Raised by the alarm of :func:`run_dghard` (a BaseException: ``run_cli`` must not map it)."""


def _child_env(env: dict | None) -> dict[str, str]:
    """The environment of the command: this one, the worktree first on PYTHONPATH, offline Hub."""
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("HF_HUB_OFFLINE", "1")
    e.update(env or {})
    return e


def run_dghard_process(
    *args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Run ``python -m dghard_cli ARGS`` in a fresh interpreter (about 2.5 s of start-up).

    Only for tests whose subject is the process itself: what a fresh interpreter imports, an
    environment read at start-up, a command line as a user types it, a timeout that must kill.
    Everything else uses :func:`run_dghard`.
    """
    return subprocess.run(
        [sys.executable, "-m", "dghard_cli", *map(str, args)],
        cwd=cwd,
        env=_child_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _check_in_process_env(before: dict[str, str], after: dict[str, str]) -> None:
    for key in sorted(set(before) | set(after)):
        if before.get(key) == after.get(key) or not key.startswith(_READ_AT_START):
            continue
        if key == "PYTHONPATH" and {p for p in after[key].split(os.pathsep) if p} <= {
            str(REPO),
            *[p for p in before.get(key, "").split(os.pathsep) if p],
        }:
            continue  # the worktree is what this interpreter imports already
        raise ValueError(f"run_dghard: {key} is read at start-up; use run_dghard_process to change it")


def _logging_state() -> list:
    loggers = [
        logging.root,
        *(v for v in logging.root.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]
    return [(lg, lg.level, lg.disabled, lg.propagate, list(lg.handlers)) for lg in loggers] + [
        logging.root.manager.disable
    ]


def _restore_logging(state: list) -> None:
    *loggers, disable = state
    for lg, level, disabled, propagate, handlers in loggers:
        lg.setLevel(level)
        lg.disabled, lg.propagate, lg.handlers[:] = disabled, propagate, handlers
    logging.disable(disable)


def run_dghard(
    *args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Run the command line in this interpreter, as ``python -m dghard_cli ARGS`` would run it.

    Returns what :func:`run_dghard_process` returns (returncode, stdout, stderr apart) at no
    start-up cost. ``cwd``, ``env``, ``sys.argv``, signal handlers and the alarm, the interrupt
    setting, torch's thread count, logging, the warning filters and the pattern-time budgets are
    restored afterwards. Errors map to exit codes exactly as in the process (``run_cli``); an
    exception that escapes the command is a bug and is raised here, failing the test. ``timeout``
    raises :class:`subprocess.TimeoutExpired`, as ``subprocess.run`` does.
    """
    from typer.testing import CliRunner

    from dghard_cli.cli import app, interrupts
    from dghard_cli.io import patterns

    argv = [str(a) for a in args]
    saved_env = dict(os.environ)
    run_env = _child_env(env)
    _check_in_process_env(saved_env, run_env)
    saved = {
        "cwd": os.getcwd(),
        "argv": sys.argv[:],
        "signals": {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)},
        "timer": signal.setitimer(signal.ITIMER_REAL, 0),
        "keep_ignoring": interrupts.KEEP_IGNORING,
        "threads": torch.get_num_threads(),
        "logging": _logging_state(),
        "spent": dict(patterns._SPENT),
    }

    def on_alarm(signum, frame):  # noqa: ARG001 - signal handler signature
        raise _InProcessTimeout

    try:
        os.environ.clear()
        os.environ.update(run_env)
        if cwd is not None:
            os.chdir(cwd)
        sys.argv = [str(REPO / "dghard_cli" / "__main__.py"), *argv]
        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout)
        with warnings.catch_warnings():
            warnings.resetwarnings()
            for action, category, module in reversed(_INTERPRETER_WARNING_FILTERS):
                warnings.filterwarnings(action, category=category, module=module)
            warnings.showwarning = warnings._showwarning_orig  # to the command's stderr, as in a process
            try:
                res = CliRunner().invoke(app, argv, prog_name=PROG_NAME)
            except _InProcessTimeout:
                raise subprocess.TimeoutExpired([PROG_NAME, *argv], timeout) from None
        if isinstance(res.exception, _InProcessTimeout):
            raise subprocess.TimeoutExpired([PROG_NAME, *argv], timeout, res.stdout, res.stderr)
        if res.exception is not None and not isinstance(res.exception, SystemExit):
            raise res.exception.with_traceback(res.exc_info[2])  # a traceback in the real process
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for s, h in saved["signals"].items():
            signal.signal(s, h)
        if saved["timer"][0]:
            signal.setitimer(signal.ITIMER_REAL, *saved["timer"])
        interrupts.KEEP_IGNORING = saved["keep_ignoring"]
        torch.set_num_threads(saved["threads"])
        _restore_logging(saved["logging"])
        patterns._SPENT.clear()
        patterns._SPENT.update(saved["spent"])
        sys.argv = saved["argv"]
        os.chdir(saved["cwd"])
        os.environ.clear()
        os.environ.update(saved_env)
    return subprocess.CompletedProcess([PROG_NAME, *argv], res.exit_code, res.stdout, res.stderr)


def interrupt_hanging_sweep(
    args: list, marker: Path, *, hang_after: int, wait: float
) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    """SIGTERM a ``dghard sweep ARGS`` process while its evaluation number ``hang_after + 1`` hangs.

    The stand-in evaluation of tests/test_sweep.py hangs after ``SWEEP_HANG_AFTER`` evaluations
    and writes its pid to ``marker``; the sweep is a real process because the signal is the
    subject. Returns the finished process and the environment to rerun it with (the same,
    without ``SWEEP_HANG_AFTER``).
    """
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", SWEEP_HANG_AFTER=str(hang_after))
    proc = subprocess.Popen(
        [sys.executable, "-m", "dghard_cli", *map(str, args)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + wait
        while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert marker.exists(), proc.communicate()
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:  # an assertion failed: no sweep left running
            proc.kill()
            proc.communicate()
    env.pop("SWEEP_HANG_AFTER")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), env


def load_dir(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, loaded with the reference safetensors library."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            assert k not in out, f"{k} stored twice"
            out[k] = v
    return out


def f64(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float64).numpy()


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def three_fine_tunes(tmp_path_factory) -> dict:
    """BASE and three fine-tunes of it (fp32, Llama tensor names, 2 layers of width 64, vocabulary
    256; the fine-tunes in 3, 1 and 2 shards), as directories and loaded: the merge methods' inputs."""
    from dghard_cli.testing.synthetic import ArchConfig, make_pair

    cfg = ArchConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2, vocab_size=256)
    root = tmp_path_factory.mktemp("merge-models")
    base, ft1 = make_pair(root / "a", cfg, ft_shards=3, seed=0)
    _, ft2 = make_pair(root / "b", cfg, ft_shards=1, seed=0, delta_seed=11)
    _, ft3 = make_pair(root / "c", cfg, ft_shards=2, seed=0, delta_seed=22)
    return {
        "base_dir": base,
        "ft_dirs": [ft1, ft2, ft3],
        "root": root,
        "base": load_dir(base),
        "fts": [load_dir(p) for p in (ft1, ft2, ft3)],
    }


def count_out_checks(monkeypatch) -> list[str]:
    """Every module of the package that holds ``check_out_path`` gets a counting one."""
    calls: list[str] = []
    for name, mod in list(sys.modules.items()):
        real = getattr(mod, "check_out_path", None) if name.startswith("dghard_cli") else None
        if real is None:
            continue

        def counted(*a, _real=real, **k):
            calls.append(str(a[0]))
            return _real(*a, **k)

        monkeypatch.setattr(mod, "check_out_path", counted)
    return calls
