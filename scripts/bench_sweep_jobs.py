#!/usr/bin/env python3
"""How much faster a sweep runs with several evaluations at a time, at what memory cost.

The same ``dghard sweep`` of the tiny example (``examples/tiny``) runs with ``--jobs 1``,
``--jobs 2`` and, when Ray is installed, ``--executor ray`` on a local Ray cluster, each a fresh
process under ``/usr/bin/time -v``. The evaluation is an evaluation-bound stand-in: it sleeps a
fixed time (``--eval-seconds``, as a GPU evaluation keeps the sweep waiting), then scores the
candidate from its weights with numpy (the share of the fine-tune's update it keeps, and how far
it strays), so the winner is a real choice. Printed: wall time and its ratio to ``--jobs 1``,
the sweep process's peak RSS, whether the evaluated set, every score and the winner are the same
as with ``--jobs 1``, and the peak RSS of one candidate write (``dghard repair`` of the pair) for
the bound "peak RSS with 2 jobs ≤ with 1 job + one candidate write".

    python scripts/bench_sweep_jobs.py                    # budget 12, 4 s per evaluation
    python scripts/bench_sweep_jobs.py --budget 16 --eval-seconds 6 --no-ray
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "tiny"

EVAL = r"""
import json, struct, sys, time
from pathlib import Path
import numpy as np

model, output, seconds, base, ft = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4], sys.argv[5]
time.sleep(seconds)  # the evaluation-bound part: a GPU evaluation keeps the sweep waiting

def load(d):  # safetensors read with numpy alone (bf16 included: its bits are float32's top half)
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        raw = f.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        for k, h in json.loads(raw[8 : 8 + n]).items():
            if k == "__metadata__":
                continue
            a, b = h["data_offsets"]
            buf = raw[8 + n + a : 8 + n + b]
            if h["dtype"] == "BF16":
                v = (np.frombuffer(buf, np.uint16).astype(np.uint32) << 16).view(np.float32)
            else:
                v = np.frombuffer(buf, {"F32": np.float32, "F16": np.float16, "F64": np.float64}[h["dtype"]])
            out[k] = v.astype(np.float64).reshape(h["shape"])
    return out

b, f, m = load(base), load(ft), load(model)
names = [n for n in b if b[n].ndim == 2 and n in m]
keep = sum(float(np.sum((m[n] - b[n]) * (f[n] - b[n]))) for n in names) / sum(float(np.sum((f[n] - b[n]) ** 2)) for n in names)
stray = sum(float(np.sum((m[n] - b[n]) ** 2)) for n in names) / sum(float(np.sum((f[n] - b[n]) ** 2)) for n in names)
Path(output).write_text(json.dumps({"task": 40 + 40 * keep, "general": 70 - 30 * stray, "chat": 50.0}))
"""


def timed(argv: list[str], env: dict) -> tuple[float, int, subprocess.CompletedProcess]:
    """Wall seconds, peak RSS (KiB) of ``argv`` under /usr/bin/time -v, and its result."""
    t0 = time.perf_counter()
    res = subprocess.run(["/usr/bin/time", "-v", *argv], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", res.stderr)
    return wall, int(m.group(1)) if m else -1, res


def comparable(doc: dict) -> dict:
    rows = [
        {
            k: r[k]
            for k in ("order", "name", "phase", "status", "params", "hm", "repair", "retention", "distance")
        }
        for r in doc["candidates"]
    ]
    return {"rows": rows, "winner": (doc["winner"] or {}).get("name")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=int, default=12)
    ap.add_argument("--eval-seconds", type=float, default=4.0)
    ap.add_argument("--no-ray", action="store_true", help="skip the local Ray cluster run")
    args = ap.parse_args()
    py = sys.executable
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    with tempfile.TemporaryDirectory(prefix="bench-sweep-jobs-") as tmp:
        work = Path(tmp)
        script = work / "eval.py"
        script.write_text(EVAL)
        q = shlex.quote
        template = (
            f"{q(py)} {q(str(script))} {{model}} {{output}} {args.eval_seconds:g} "
            f"{q(str(TINY / 'base'))} {q(str(TINY / 'ft'))}"
        )
        runs = [("--jobs 1", ["--jobs", "1"]), ("--jobs 2", ["--jobs", "2"])]
        if not args.no_ray:
            try:
                import ray  # noqa: F401
            except ImportError:
                print("ray is not installed: the Ray row is skipped (pip install 'dghard[ray]')")
            else:
                runs.append(("--executor ray --jobs 2 (local cluster)", ["--executor", "ray", "--jobs", "2"]))
        results = []
        for label, extra in runs:
            out = work / re.sub(r"\W+", "_", label)
            argv = [py, "-m", "dghard_cli", "sweep", str(TINY / "base"), str(TINY / "ft"), str(out)]
            argv += ["--eval", template, "--budget", str(args.budget), "--json", "--quiet", *extra]
            wall, rss, res = timed(argv, env)
            if res.returncode != 0:
                print(f"{label}: exit {res.returncode}\n{res.stderr[-3000:]}")
                return 1
            doc = json.loads((out / "sweep_report.json").read_text())
            results.append((label, wall, rss, doc))
        wall_w, rss_w, res = timed(
            [py, "-m", "dghard_cli", "repair", str(TINY / "base"), str(TINY / "ft"), str(work / "one-write")],
            env,
        )
        wall_i, rss_i, _ = timed([py, "-c", "import torch, dghard_cli.repairing"], env)
        write_kib = max(0, rss_w - rss_i)
        base_label, base_wall, base_rss, base_doc = results[0]
        print(
            f"dghard sweep of examples/tiny, --budget {args.budget}, each evaluation sleeping "
            f"{args.eval_seconds:g} s, on {os.cpu_count()} CPU cores"
        )
        print(
            f"{'run':44s} {'wall s':>8s} {'× faster':>9s} {'peak RSS MiB':>13s}  same evaluations and winner"
        )
        for label, wall, rss, doc in results:
            same = comparable(doc) == comparable(base_doc)
            if not same:
                for a, b in zip(comparable(doc)["rows"], comparable(base_doc)["rows"], strict=False):
                    diff = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
                    if diff:
                        print(f"  {label}: {a['name']} differs: {diff}")
            print(
                f"{label:44s} {wall:8.1f} {base_wall / wall:9.2f} {rss / 1024:13.0f}  "
                f"{'yes' if same else 'NO'} (winner {(doc['winner'] or {}).get('name')})"
            )
        print(
            f"one candidate write (dghard repair of the pair): peak RSS {rss_w / 1024:.0f} MiB, of which "
            f"{write_kib / 1024:.0f} MiB above the interpreter with torch loaded ({rss_i / 1024:.0f} MiB)"
        )
        two = results[1]
        bound = base_rss + write_kib
        ok = two[2] <= bound and base_wall / two[1] >= 1.8 and comparable(two[3]) == comparable(base_doc)
        print(
            f"--jobs 2: {base_wall / two[1]:.2f}× (goal ≥ 1.8×), peak RSS {two[2] / 1024:.0f} MiB "
            f"(bound: 1 job + one write = {bound / 1024:.0f} MiB): {'ok' if ok else 'NOT MET'}"
        )
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
