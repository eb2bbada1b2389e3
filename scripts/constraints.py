"""The lock of what CI installs: ``constraints.txt`` checked against an environment, or moved forward.

``.ci/run`` installs every package through ``constraints.txt`` (``pip install -c``), so a fresh
clone next month installs what passed today; an upstream release (PEFT 0.22 added a config key
and turned the suite red) cannot change CI until the pins are moved on purpose.

    python scripts/constraints.py check               # this environment's packages against the lock
    python scripts/constraints.py update [--venv DIR] [--real-model]

``check`` compares ``pip freeze`` with the file: one line per package that differs, exit 1,
or one summary line and exit 0 (``.ci/run`` prints it, so a CI log shows what it tested).

``update`` builds a fresh virtual environment with the newest releases that the extras allow
(torch stays at the tested 2.13.0, the CPU build where PyTorch's CPU index answers), runs
``ruff check``, ``ruff format --check`` and the test suite in it (with ``--real-model``, the
real-model check too), and only when all pass rewrites ``constraints.txt`` from its ``pip freeze``.
A failure leaves the file as it was and names the step; the environment stays for a look.
About 15 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "constraints.txt"
TORCH = "2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
#: Not pinned: the package under test (installed editable).
SKIP = {"dghard"}


def _name(req: str) -> str:
    return re.sub(r"[-_.]+", "-", req.split("==", 1)[0].strip()).lower()


def _version(v: str) -> str:
    """A version without its local label: the CPU build ``2.13.0+cpu`` is the pinned ``2.13.0``."""
    return v.strip().split("+", 1)[0]


def read_pins(text: str) -> dict[str, str]:
    """``name -> version`` of the ``name==version`` lines (comments and blank lines skipped)."""
    pins: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if "==" not in line or any(c in line for c in "<>!~;@ "):
            raise ValueError(f"constraints.txt: {raw!r} is not a plain name==version pin")
        name, version = line.split("==", 1)
        pins[_name(name)] = _version(version)
    return pins


def freeze(python: str) -> dict[str, str]:
    out = subprocess.run(
        [python, "-m", "pip", "freeze", "--all", "--exclude-editable"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    pins: dict[str, str] = {}
    for line in out.splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            if _name(name) not in SKIP:
                pins[_name(name)] = _version(version)
    return pins


def cuda_runtime(name: str) -> bool:
    """A wheel that only torch's CUDA build pulls in (``.ci/run``'s fallback where PyTorch's CPU
    index is unreachable): pinned by that torch build itself, not by this CPU lock."""
    return name.startswith("nvidia-") or name in ("triton", "cuda-bindings", "cuda-pathfinder")


def compare(installed: dict[str, str], pinned: dict[str, str]) -> list[str]:
    """One line per package installed at another version than pinned, or installed unpinned
    (torch's CUDA runtime wheels excepted: :func:`cuda_runtime`)."""
    problems = []
    for name in sorted(n for n in installed if not cuda_runtime(n)):
        if name not in pinned:
            problems.append(f"{name}=={installed[name]} is installed but not pinned")
        elif installed[name] != pinned[name]:
            problems.append(f"{name}=={installed[name]} is installed; constraints.txt pins {pinned[name]}")
    return problems


def check(python: str = sys.executable) -> int:
    pinned = read_pins(LOCK.read_text())
    installed = freeze(python)
    problems = compare(installed, pinned)
    for p in problems:
        print(f"constraints: {p}", file=sys.stderr)
    if problems:
        print(
            f"constraints: {len(problems)} of {len(installed)} installed packages differ from "
            "constraints.txt; install with `pip install -c constraints.txt ...`",
            file=sys.stderr,
        )
        return 1
    print(
        f"constraints: all {len(installed)} installed packages are the versions constraints.txt pins "
        f"({len(pinned)} pins; torch {installed.get('torch', 'not installed')}, "
        f"peft {installed.get('peft', '-')}, transformers {installed.get('transformers', '-')}, "
        f"lm-eval {installed.get('lm-eval', '-')}, ray {installed.get('ray', '-')})"
    )
    return 0


def _run(step: str, cmd: list[str], **kw) -> None:
    print(f"update: {step}: {' '.join(cmd)}", flush=True)
    if subprocess.run(cmd, cwd=REPO, env=_ENV, **kw).returncode != 0:
        raise SystemExit(f"update: {step} failed; constraints.txt is unchanged")


def render(pins: dict[str, str]) -> str:
    now = dt.date.today().isoformat()
    head = [
        "# What CI installs, pinned: .ci/run and the README's test command install through this file",
        "# (pip install -c constraints.txt). Written by `python scripts/constraints.py update` on",
        f"# {now} after ruff and the whole test suite passed with exactly these versions",
        f"# (CPython {platform.python_version()}, {platform.system()} {platform.machine()}).",
        "# Move the pins forward with that command, never by hand (docs/development.md).",
    ]
    return "\n".join(head + [f"{n}=={v}" for n, v in sorted(pins.items())]) + "\n"


#: The environment of each step: the new one's interpreter first on PATH, as `activate` does
#: (the tests' evaluation commands run `python`, which must be the environment's).
_ENV: dict[str, str] = dict(os.environ)


def update(venv: Path, real_model: bool) -> int:
    _ENV.update(VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    _ENV.pop("PYTHONHOME", None)
    _run("venv", [sys.executable, "-m", "venv", "--clear", str(venv)])
    py = str(venv / "bin" / "python")
    _run("pip", [py, "-m", "pip", "install", "--quiet", "--upgrade", "pip"])
    torch = [py, "-m", "pip", "install", "--quiet", "--no-deps", f"torch=={TORCH}"]
    if subprocess.run(
        [*torch, "--timeout", "20", "--retries", "0", "--index-url", CPU_INDEX], env=_ENV
    ).returncode:
        _run("torch", torch)
    _run("install", [py, "-m", "pip", "install", "--quiet", "--upgrade", "-e", ".[test]"])
    _run("ruff check", [py, "-m", "ruff", "check", "."])
    _run("ruff format", [py, "-m", "ruff", "format", "--check", "."])
    _run("tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider"])
    if real_model:
        _run("real-model check", [py, "scripts/real_model_check.py"])
    pins = freeze(py)
    old = read_pins(LOCK.read_text()) if LOCK.exists() else {}
    LOCK.write_text(render(pins))
    moved = [f"{n} {old.get(n, 'new')} -> {v}" for n, v in sorted(pins.items()) if old.get(n) != v]
    gone = sorted(set(old) - set(pins))
    print(f"update: constraints.txt rewritten: {len(pins)} pins, {len(moved)} moved, {len(gone)} dropped")
    for line in moved + [f"{n} dropped" for n in gone]:
        print(f"  {line}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="this environment's packages against constraints.txt")
    c.add_argument("--python", default=sys.executable, help="the interpreter whose packages to check")
    u = sub.add_parser("update", help="newest releases, full suite, then rewrite constraints.txt")
    u.add_argument(
        "--venv", type=Path, default=None, help="where to build the environment (default: a temporary one)"
    )
    u.add_argument("--real-model", action="store_true", help="also run scripts/real_model_check.py")
    args = ap.parse_args(argv)
    if args.cmd == "check":
        return check(args.python)
    return update(args.venv or Path(tempfile.mkdtemp(prefix="dghard-lock-")) / "venv", args.real_model)


if __name__ == "__main__":
    sys.exit(main())
