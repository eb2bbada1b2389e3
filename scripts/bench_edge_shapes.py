"""Peak memory of 1×N and N×1 matrices (docs/robustness.md, "Shapes and memory at the edges").

Writes a float32 BASE and two fine-tunes holding one 1 × 10^8 (then 10^8 × 1) matrix, 400 MB
each, and runs ``repair`` and TIES (one and two fine-tunes) on them, each in its own process
under ``/usr/bin/time -v``; prints peak RSS and wall time. Needs about 1.2 GB of disk in DIR.

    python scripts/bench_edge_shapes.py [DIR]      # default /tmp/dghard-edge
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

N = 10**8
NAME = "model.layers.0.mlp.up_proj.weight"


def peak(args: list[str]) -> tuple[int, float, str]:
    p = subprocess.run(
        ["/usr/bin/time", "-v", sys.executable, "-m", "dghard_cli", *args, "-q"],
        capture_output=True,
        text=True,
    )
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1)) / 1024
    wall = re.search(r"Elapsed \(wall clock\) time.*: (\S+)", p.stderr).group(1)
    return p.returncode, rss, wall


def main(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
    for shape_name, shape in (("1 x 10^8", (1, N)), ("10^8 x 1", (N, 1))):
        r = root / shape_name.replace(" ", "").replace("^", "")
        for d, seed in (("base", 0), ("ft", 1), ("ft2", 2)):
            (r / d).mkdir(parents=True)
            g = torch.Generator().manual_seed(seed)
            save_file({NAME: torch.randn(shape, generator=g)}, str(r / d / "model.safetensors"))
        runs = {
            "repair": ["repair", f"{r}/base", f"{r}/ft", f"{r}/o1"],
            "merge --method ties, one fine-tune": ["merge", "--method", "ties", f"{r}/base", f"{r}/ft", "--out", f"{r}/o2"],
            "merge --method ties, two fine-tunes": [
                "merge", "--method", "ties", "--weights", "1,1", f"{r}/base", f"{r}/ft", f"{r}/ft2", "--out", f"{r}/o3",
            ],
        }  # fmt: skip
        for label, args in runs.items():
            rc, rss, wall = peak(args)
            print(f"{shape_name:9}  {label:36}  exit {rc}  peak RSS {rss:7,.0f} MB  wall {wall}", flush=True)
        shutil.rmtree(r)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/dghard-edge"))
