#!/usr/bin/env python3
"""The machine's floors under a dghard command, measured in a fresh process like the command's.

- **start-up**: a Python process importing torch and safetensors and exiting (every command
  pays it; ``timings.total`` in a report includes it);
- **I/O floor**: reading every input byte the command reads, with dghard's own reader
  (``TensorInfo.read_raw``, the prefetch thread's call), and writing as many bytes as the
  command's output into one file in 64 MB writes, no compute; the pages come from the same
  cache as the command's (the files were just written or read);
- **compute floor** of a spectral route: the float64 Gram products (N·M² multiply-adds for an
  N × M tall form, the symmetric rank-k update a BLAS ``syrk`` does: half of the general product
  the engine runs) at this machine's measured float64 GEMM rate, plus each M × M eigensolve timed
  alone (``torch.linalg.eigh``), for the matrices the command's report says it treated.

``scripts/bench_cpu.py`` runs each beside the commands in one invocation and prints each command's
ratio to start-up + max(I/O floor, compute floor).

    python scripts/floors.py startup
    python scripts/floors.py io OUT_BYTES SCRATCH_DIR CHECKPOINT [CHECKPOINT ...]
    python scripts/floors.py compute REPORT.json GRAMS EIGHS    # per treated matrix
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHUNK = 64 * 1024 * 1024


def startup_seconds(python: str = sys.executable, reps: int = 3) -> float:
    """The fastest of ``reps`` fresh processes importing torch and safetensors."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        subprocess.run([python, "-c", "import torch, safetensors"], check=True)
        best = min(best, time.perf_counter() - t0)
    return best


def io_floor(inputs: list[Path], out_bytes: int, scratch: Path) -> dict:
    """Read every tensor of ``inputs`` with dghard's reader, then write ``out_bytes``."""
    from dghard_cli.io.checkpoint import Checkpoint

    t0 = time.perf_counter()
    read = 0
    for d in inputs:
        ck = Checkpoint(d, label=str(d))
        try:
            for info in ck.tensors.values():
                raw = info.read_raw()
                read += raw.numel()
                del raw
        finally:
            ck.close()
    t_read = time.perf_counter() - t0
    scratch.mkdir(parents=True, exist_ok=True)
    target = scratch / "floor.bin"
    block = bytes(min(CHUNK, max(1, out_bytes)))
    t1 = time.perf_counter()
    with open(target, "wb") as fh:
        left = out_bytes
        while left > 0:
            n = min(left, len(block))
            fh.write(block[:n] if n < len(block) else block)
            left -= n
    t_write = time.perf_counter() - t1
    target.unlink()
    return {"read_s": t_read, "write_s": t_write, "io_s": t_read + t_write, "bytes_read": read}


def gemm_rate(n: int = 2048, reps: int = 3) -> float:
    """Float64 multiply-adds per second of one n × n product (the best of ``reps``)."""
    import torch

    a = torch.randn((n, n), dtype=torch.float64)
    b = torch.randn((n, n), dtype=torch.float64)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return n**3 / best


def treated_shapes(report: dict) -> list[tuple[int, int]]:
    """(N, M) tall forms of the matrices the command gave a spectral treatment, from its report."""
    out = []
    for r in report["tensors"]:
        if r.get("action") not in ("method", "resized") or len(r.get("shape", ())) != 2:
            continue
        if "rank_kept" not in r and "route" not in r:
            continue
        rows, cols = r["shape"]
        out.append((max(rows, cols), min(rows, cols)))
    return out


def compute_floor(shapes: list[tuple[int, int]], grams: int, eighs: int) -> dict:
    """``grams`` Gram products and ``eighs`` eigensolves per (N, M) shape, float64."""
    import torch

    rate = gemm_rate()
    gram_s = sum(grams * n * m * m for n, m in shapes) / rate
    eigh_of: dict[int, float] = {}
    for m in sorted({m for _, m in shapes}):
        x = torch.randn((m, m), dtype=torch.float64)
        g = x @ x.T
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            torch.linalg.eigh(g)
            best = min(best, time.perf_counter() - t0)
        eigh_of[m] = best
    eigh_s = eighs * sum(eigh_of[m] for _, m in shapes)
    return {
        "gemm_gflops": 2 * rate / 1e9,
        "gram_s": gram_s,
        "eigh_s": eigh_s,
        "compute_s": gram_s + eigh_s,
        "matrices": len(shapes),
    }


def run_json(args: list[str], env: dict | None = None) -> dict:
    """This script in a fresh process (as a command runs); its JSON result."""
    env = dict(env or os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"floors.py {' '.join(args)} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(REPO))
    cmd = argv[0] if argv else ""
    if cmd == "startup":
        print(json.dumps({"startup_s": startup_seconds()}))
    elif cmd == "io":
        out_bytes, scratch, *inputs = argv[1:]
        print(json.dumps(io_floor([Path(p) for p in inputs], int(out_bytes), Path(scratch))))
    elif cmd == "compute":
        report, grams, eighs = argv[1], int(argv[2]), int(argv[3])
        shapes = treated_shapes(json.loads(Path(report).read_text()))
        print(json.dumps(compute_floor(shapes, grams, eighs)))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
