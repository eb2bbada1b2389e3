#!/usr/bin/env python3
"""CPU benchmark on a Qwen2.5-0.5B-shaped checkpoint pair: time and peak memory, with ratios.

Generates (once, in ``--workdir``) a base and two fine-tunes shaped like Qwen2.5-0.5B (hidden
896, intermediate 4864, 24 layers, vocabulary 151936, tied embeddings, bf16, sharded); each
fine-tune is the base plus a low-rank signal and i.i.d. noise on every matrix. Then runs, each
under ``/usr/bin/time -v`` in its own process, and prints wall time, peak RSS and ratios:

- ``dghard repair BASE FT``                    vs  a naive baseline written here (both models
  in memory, ``torch.linalg.svd`` on every matrix: the approach of the paper's reference code);
- ``dghard merge --method ties BASE FT FT2``   vs  ``mergekit-yaml`` 0.1.5 TIES, same
  parameters (mergekit installed into its own virtual environment on first use);
- ``dghard merge --method task-arithmetic | tsv | iso-c BASE FT FT2``;

and, for each dghard command, the machine's floors measured in the same invocation
(``scripts/floors.py``: the start-up of a Python process importing torch, the I/O floor of its
inputs and output bytes, the compute floor of its spectral route), its ratio to start-up +
max(I/O, compute), and where its time went (the report's ``timings.stages``). Each row also
gives the CPU time the hypervisor took for other guests while it ran (``/proc/stat`` steal): on
a shared virtual machine a run with steal well above 0 is not comparable with a quiet one.

It checks that the naive baseline keeps the same ranks and values as ``dghard repair`` and that
the two TIES outputs agree (≤ 1e-6 relative, float32 outputs).

    python scripts/bench_cpu.py                       # everything (~2 GB per model on disk)
    python scripts/bench_cpu.py --layers 4 --skip-mergekit --skip-naive
    python scripts/bench_cpu.py --models BASE FT FT2 --workdir /tmp/bench-real   # a real model
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))


# -- the naive baseline ---------------------------------------------------------------------


def naive_repair(base: Path, ft: Path, out: Path) -> None:
    """Both models in memory, full SVD per matrix, the Gavish–Donoho cut, save."""
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    from dghard_cli.spectral.marchenko_pastur import omega

    def load(d: Path) -> dict[str, torch.Tensor]:
        t: dict[str, torch.Tensor] = {}
        for p in sorted(d.glob("*.safetensors")):
            t.update(load_file(str(p)))
        return t

    b_all, f_all = load(base), load(ft)
    out.mkdir(parents=True, exist_ok=True)
    index = json.loads((ft / "model.safetensors.index.json").read_text())["weight_map"]
    ranks = {}
    result = {}
    for name, f in f_all.items():
        b = b_all[name]
        if f.ndim == 2 and f.numel() >= 1024:
            d = f.float() - b.float()
            u, s, vh = torch.linalg.svd(d, full_matrices=False)
            m, n = d.shape
            tau = omega(min(m, n) / max(m, n)) * float(np.median(s.double().numpy()))
            k = int((s > tau).sum())
            ranks[name] = k
            result[name] = (b.float() + (u[:, :k] * s[:k]) @ vh[:k]).to(f.dtype)
        else:
            result[name] = f
    for shard in sorted(set(index.values())):
        save_file(
            {n: result[n].contiguous() for n, s in index.items() if s == shard},
            str(out / shard),
            metadata={"format": "pt"},
        )
    shutil.copy(ft / "model.safetensors.index.json", out)
    (out / "naive_ranks.json").write_text(json.dumps(ranks))


# -- generation -----------------------------------------------------------------------------


def qwen05b(layers: int):
    from dghard_cli.testing.synthetic import ArchConfig

    return ArchConfig(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    )


def generate(work: Path, layers: int, fine_tunes: int = 2) -> tuple[Path, ...]:
    """BASE and ``fine_tunes`` fine-tunes of it (``ft``, ``ft2``, ``ft3``, ...: delta seeds 0, 1, 2, ...)."""
    from dghard_cli.testing.synthetic import DeltaModel, make_pair

    cfg = qwen05b(layers)
    dm = DeltaModel(rank=8, signal=4.0, noise=1e-3, weight_std=0.02)
    base, ft = work / "base", work / "ft"
    if not (ft / "model.safetensors.index.json").exists():
        print(f"generating a Qwen2.5-0.5B-shaped pair ({layers} layers) in {work} ...", flush=True)
        make_pair(work, cfg, dtype="bfloat16", base_shards=2, ft_shards=2, seed=0, delta=dm)
    fts = [ft]
    for i in range(2, fine_tunes + 1):
        fti = work / f"ft{i}"
        if not (fti / "model.safetensors.index.json").exists():
            tmp = work / "second"
            make_pair(
                tmp, cfg, dtype="bfloat16", base_shards=1, ft_shards=2, seed=0, delta=dm, delta_seed=i - 1
            )
            shutil.rmtree(fti, ignore_errors=True)
            (tmp / "ft").rename(fti)
            shutil.rmtree(tmp)
        fts.append(fti)
    return (base, *fts)


# -- measuring ------------------------------------------------------------------------------


def cpu_times() -> tuple[int, int] | None:
    """(steal, total) clock ticks of all CPUs from /proc/stat (None elsewhere)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def timed(cmd: list[str], env: dict | None = None) -> dict:
    """Wall time and peak RSS of a command, as /usr/bin/time -v reports them, and the share of
    the machine's CPU time its hypervisor took for other guests meanwhile (steal: a virtual
    machine's timings are comparable only when it is near 0)."""
    timer = ["/usr/bin/time", "-v"] if Path("/usr/bin/time").exists() else []
    c0 = cpu_times()
    t0 = time.perf_counter()
    r = subprocess.run(timer + cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    c1 = cpu_times()
    steal = (c1[0] - c0[0]) / max(1, c1[1] - c0[1]) if c0 and c1 else float("nan")
    if r.returncode != 0:
        raise SystemExit(
            f"command failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
        )
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr)
    peak = int(m.group(1)) / 1024 if m else float("nan")
    return {"wall_s": wall, "peak_rss_mb": peak, "steal": steal, "stdout": r.stdout}


def compare_dirs(a: Path, b: Path) -> float:
    """Largest relative Frobenius difference over the tensors both directories hold."""
    import torch
    from safetensors.torch import load_file

    def load(d):
        t = {}
        for p in sorted(d.glob("*.safetensors")):
            t.update(load_file(str(p)))
        return t

    ta, tb = load(a), load(b)
    worst = 0.0
    for k, v in ta.items():
        w = tb[k].double()
        den = float(torch.linalg.norm(w)) or 1.0
        worst = max(worst, float(torch.linalg.norm(v.double() - w)) / den)
    return worst


#: per treated matrix: (Gram products, eigensolves) the spectral route must do, T fine-tunes
SPECTRAL_WORK = {"repair": lambda t: (1, 1), "tsv": lambda t: (t, t), "iso-c": lambda t: (1, 1)}


def dghard(py: str, args: list[str], env: dict) -> dict:
    return timed([py, "-m", "dghard_cli", *args, "--device", "cpu", "-q"], env)


def main() -> None:
    from floors import run_json

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "dghard-bench-cpu")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--density", type=float, default=0.2)
    ap.add_argument("--skip-mergekit", action="store_true")
    ap.add_argument("--skip-naive", action="store_true")
    ap.add_argument(
        "--models",
        nargs=3,
        type=Path,
        metavar=("BASE", "FT", "FT2"),
        help="run the same table on these checkpoints instead of the generated pair (a real model)",
    )
    ap.add_argument("--naive", nargs=3, type=Path, metavar=("BASE", "FT", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.naive:
        naive_repair(*args.naive)
        return

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    base, ft, ft2 = args.models if args.models else generate(work, args.layers)
    size = sum(p.stat().st_size for p in ft.glob("*.safetensors"))
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    py = sys.executable
    rows: list[tuple[str, dict]] = []
    floors: dict[str, dict] = {}  # command -> its floors
    scratch = work / "floor_scratch"

    def measure(label: str, out: Path, inputs: list[Path], work_of: str | None, t: int) -> None:
        """The floors of the command that just wrote ``out``, from its report."""
        report = json.loads((out / "dghard_report.json").read_text())
        io = run_json(["io", str(report["output"]["bytes"]), str(scratch), *map(str, inputs)], env)
        comp = {"compute_s": 0.0, "gram_s": 0.0, "eigh_s": 0.0, "matrices": 0}
        if work_of is not None:
            grams, eighs = SPECTRAL_WORK[work_of](t)
            comp = run_json(["compute", str(out / "dghard_report.json"), str(grams), str(eighs)], env)
        floors[label] = {**io, **comp, "stages": report["timings"].get("stages", {})}

    for d in ("out_repair", "out_naive", "out_ties", "out_mergekit", "out_ta", "out_tsv", "out_iso"):
        shutil.rmtree(work / d, ignore_errors=True)
    startup = run_json(["startup"], env)["startup_s"]
    rep = dghard(py, ["repair", str(base), str(ft), str(work / "out_repair")], env)
    rows.append(("dghard repair", rep))
    measure("dghard repair", work / "out_repair", [base, ft], "repair", 1)
    nai = None
    if not args.skip_naive:
        nai = timed([py, __file__, "--naive", str(base), str(ft), str(work / "out_naive")], env)
        rows.append(("naive repair (torch.linalg.svd)", nai))
        report = json.loads((work / "out_repair" / "dghard_report.json").read_text())
        ours = {r["name"]: r["rank_kept"] for r in report["tensors"] if "rank_kept" in r}
        theirs = json.loads((work / "out_naive" / "naive_ranks.json").read_text())
        rank_mismatch = sum(1 for k, v in ours.items() if theirs.get(k) != v)
        diff = compare_dirs(work / "out_repair", work / "out_naive")

    merges = [
        ("dghard merge --method task-arithmetic", "out_ta", ["--method", "task-arithmetic"], None),
        (
            "dghard merge --method ties",
            "out_ties",
            ["--method", "ties", "--density", str(args.density), "--weights", "1,1", "--dtype", "fp32"],
            None,
        ),
        ("dghard merge --method tsv", "out_tsv", ["--method", "tsv", "--dtype", "bf16"], "tsv"),
        ("dghard merge --method iso-c", "out_iso", ["--method", "iso-c", "--dtype", "bf16"], "iso-c"),
    ]
    for label, d, argv, work_of in merges:
        r = dghard(py, ["merge", *argv, str(base), str(ft), str(ft2), "--out", str(work / d)], env)
        rows.append((label, r))
        measure(label, work / d, [base, ft, ft2], work_of, 2)
    ties = dict(rows)["dghard merge --method ties"]

    mk = None
    if not args.skip_mergekit:
        from compare_mergekit import ensure_mergekit, venv_dir

        exe = ensure_mergekit(venv_dir(None))
        recipe = work / "mergekit_ties.yml"
        recipe.write_text(
            "merge_method: ties\n"
            f"base_model: {base}\n"
            "models:\n"
            + "".join(
                f"  - model: {m}\n    parameters:\n      weight: 1.0\n      density: {args.density}\n"
                for m in (ft, ft2)
            )
            + "parameters:\n  normalize: true\n  lambda: 1.0\n"
            "dtype: float32\n"
        )
        mk = timed(
            [str(exe), str(recipe), str(work / "out_mergekit"), "--allow-crimes"],
            dict(env, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"),
        )
        rows.append(("mergekit-yaml 0.1.5 ties", mk))
        from compare_mergekit import compare

        ties_diff, _, _, tied, tied_differ = compare(
            work / "out_ties", work / "out_mergekit", base, [ft, ft2], args.density
        )

    print()
    what = f"{base}, {ft}, {ft2}" if args.models else f"Qwen2.5-0.5B-shaped pair, {args.layers} layers, bf16"
    print(
        f"{what}, {size / 1e9:.2f} GB per checkpoint, "
        f"{os.cpu_count()} CPU cores; start-up (import torch, safetensors) {startup:.1f} s"
    )
    print()
    print(
        "| command | wall s | peak RSS MB | I/O floor s | compute floor s | floor s | wall / floor | CPU steal |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows:
        f = floors.get(name)
        steal = f"{100 * r.get('steal', float('nan')):.0f} %"
        if f is None:
            print(f"| {name} | {r['wall_s']:.1f} | {r['peak_rss_mb']:.0f} | | | | | {steal} |")
            continue
        floor = startup + max(f["io_s"], f["compute_s"])
        print(
            f"| {name} | {r['wall_s']:.1f} | {r['peak_rss_mb']:.0f} | {f['io_s']:.1f} | {f['compute_s']:.1f} | "
            f"{floor:.1f} | {r['wall_s'] / floor:.1f} | {steal} |"
        )
    print()
    print("where each command's streaming time went (its report's timings.stages; threads overlap):")
    print("| command | read | read inline | compute | write | wait read | wait write |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, f in floors.items():
        st = f["stages"]
        print(
            f"| {name} | "
            + " | ".join(
                f"{st.get(k, 0.0):.1f}"
                for k in ("read", "read_inline", "compute", "write", "wait_read", "wait_write")
            )
            + " |"
        )
    print()
    print(
        "floors: I/O = reading every input byte with dghard's reader + writing the output's bytes; "
        "compute = the float64 Gram products (syrk count, at "
        f"{next(iter(f['gemm_gflops'] for f in floors.values() if 'gemm_gflops' in f), float('nan')):.0f} GFLOP/s "
        "measured) and eigensolves of the matrices the report says were treated; floor = start-up + the larger"
    )
    if nai is not None:
        print(
            f"repair: dghard / naive wall = {rep['wall_s'] / nai['wall_s']:.2f}, "
            f"peak RSS = {rep['peak_rss_mb'] / nai['peak_rss_mb']:.2f}; "
            f"rank mismatches {rank_mismatch}/{len(ours)}; max relative difference {diff:.2e}"
        )
    if mk:
        print(
            f"ties: mergekit / dghard wall = {mk['wall_s'] / ties['wall_s']:.2f}x, "
            f"peak RSS dghard {ties['peak_rss_mb']:.0f} MB vs mergekit {mk['peak_rss_mb']:.0f} MB; "
            f"max relative difference {ties_diff:.2e} outside the {tied} entries that tie exactly at the "
            f"top-k threshold (mergekit's unstable sort picks among them arbitrarily; {tied_differ} differ)"
        )


if __name__ == "__main__":
    main()
