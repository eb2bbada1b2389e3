#!/usr/bin/env python3
"""Peak RSS and wall time of the spectral merges (TSV-M, Iso-C, Iso-CTS, STAR, CART, WUDI, SVC) against TIES at 0.5B shapes.

Generates, with ``scripts/bench_cpu.py``'s generator, a Qwen2.5-0.5B-shaped bf16 base and three
fine-tunes (``--layers`` decoder layers, the full 151936 × 896 tied embedding), then runs, each
in its own process under ``/usr/bin/time -v``::

    dghard merge --method ties --density 0.2 BASE FT FT2 FT3 --out ...
    dghard merge --method tsv | iso-c | iso-cts | star | cart | wudi BASE FT FT2 FT3 --out ...
    dghard merge --method ties --density 0.2 --calibrate svc BASE FT FT2 FT3 --out ...

and prints one markdown table (wall, peak RSS). The checkpoints are deleted at the end unless
``--keep``.

    python scripts/bench_spectral.py --layers 8
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cpu import REPO, generate, timed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "dghard-bench-spectral")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--density", type=float, default=0.2)
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoints")
    args = ap.parse_args()
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    try:
        base, *fts = generate(work, args.layers, fine_tunes=3)
        size = sum(p.stat().st_size for p in fts[0].glob("*.safetensors"))
        env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
        models = [str(base), *(str(f) for f in fts)]
        rows = []
        for method, extra in (
            ("ties", ["--density", str(args.density)]),
            ("tsv", []),
            ("iso-c", []),
            ("iso-cts", []),
            ("star", []),
            ("cart", []),
            ("wudi", []),
            ("ties", ["--density", str(args.density), "--calibrate", "svc"]),
        ):
            out = work / f"out_{method}{'_svc' if '--calibrate' in extra else ''}"
            shutil.rmtree(out, ignore_errors=True)
            cmd = [sys.executable, "-m", "dghard_cli", "merge", "--method", method, *extra, *models]
            r = timed([*cmd, "--out", str(out), "--device", "cpu", "-q"], env)
            print(f"{method}: {r['wall_s']:.1f} s, {r['peak_rss_mb']:.0f} MB", flush=True)
            rows.append((method, extra, r))
            shutil.rmtree(out, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(
        f"Qwen2.5-0.5B-shaped base + 3 fine-tunes, {args.layers} layers, vocabulary 151936, bf16, "
        f"{size / 1e9:.2f} GB per checkpoint"
    )
    print()
    print("| command | wall | peak RSS |")
    print("|---|---|---|")
    for method, extra, r in rows:
        flags = " ".join(["--method", method, *extra])
        print(f"| `dghard merge {flags} BASE FT FT2 FT3` | {r['wall_s']:.1f} s | {r['peak_rss_mb']:.0f} MB |")


if __name__ == "__main__":
    main()
