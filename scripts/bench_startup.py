#!/usr/bin/env python3
"""How long the command line takes to start: ``dghard --version``, ``dghard --help`` and
``dghard COMMAND --help`` for every command, each a fresh process, best of N runs (wall clock,
and the CPU time the process used, which a busy machine inflates less), against the floor
of a bare ``python -c pass`` and the import of torch that a start-up no longer pays.

    python scripts/bench_startup.py            # 5 runs each
    python scripts/bench_startup.py --runs 9 --limit 0.5   # exit 1 if any best wall time > 0.5 s
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def measure(argv: list[str], runs: int) -> tuple[float, float]:
    """Best wall time and best CPU time (user + system) of ``argv`` over ``runs`` runs."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    walls, cpus = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        walls.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
    return min(walls), min(cpus)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--limit", type=float, default=None, help="exit 1 when a best wall time exceeds this")
    args = ap.parse_args()
    from dghard_cli.cli import COMMANDS

    py = sys.executable
    rows = [
        ("python -c pass (floor)", [py, "-c", "pass"]),
        ("python -c 'import torch' (what start-up no longer pays)", [py, "-c", "import torch"]),
        ("dghard --version", [py, "-m", "dghard_cli", "--version"]),
        ("dghard --help", [py, "-m", "dghard_cli", "--help"]),
        *[(f"dghard {c} --help", [py, "-m", "dghard_cli", c, "--help"]) for c in COMMANDS],
    ]
    print(f"| command (best of {args.runs}) | wall | CPU |")
    print("|---|---:|---:|")
    worst = 0.0
    for label, argv in rows:
        wall, cpu = measure(argv, args.runs)
        if label.startswith("dghard"):
            worst = max(worst, wall)
        print(f"| `{label}` | {wall:.3f} s | {cpu:.3f} s |", flush=True)
    if args.limit is not None and worst > args.limit:
        print(f"slowest dghard start-up {worst:.3f} s is over the limit {args.limit} s", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
