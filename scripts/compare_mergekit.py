#!/usr/bin/env python3
"""Run `mergekit-yaml` (mergekit 0.1.5) and `dghard merge` on the same mergekit recipe and the
same generated models, for every merge method both tools have; compare every tensor and print
wall time, peak RSS and their ratios, and the largest differences.

    python scripts/compare_mergekit.py                          # every method, base + 2 fine-tunes
    python scripts/compare_mergekit.py --methods ties,slerp --hidden 896 --intermediate 4864

Each method gets one mergekit recipe (``<workdir>/<method>.yml``) that both tools run as a user
runs them: ``mergekit-yaml R.yml OUT`` and ``dghard merge --config R.yml --out OUT`` (each a fresh
process, start-up included, best of ``--repeat``; peak RSS of that process, as
``/usr/bin/time -v`` reports it). mergekit 0.1.5 is installed from PyPI into its own virtual
environment the first time (torch 2.13.0 first, so pip takes the CPU build instead of pulling a
CUDA one; mergekit 0.1.5 only asks for torch>=2.0). The environment lives in the system temp
directory (``<tmp>/dghard-mergekit-0.1.5``) or where ``--venv`` / ``DGHARD_MERGEKIT_VENV`` say;
it is never part of the repository. Both tools run offline on CPU (mergekit without ``--cuda``),
on float32 checkpoints with a ``config.json`` written by ``dghard_cli.testing.synthetic``.

Differences reported per method:

- deterministic methods: the largest absolute difference and the largest relative Frobenius
  error over all tensors (exit status 1 above 1e-6). For slerp both outputs are also measured
  against the definition evaluated in float64: mergekit sums the dot product in float32, and
  arccos amplifies that error for nearly colinear tensors (dghard's accumulation is float64). For ties/breadcrumbs, entries tied exactly
  at a top-k threshold in mergekit's float32 are left out and counted: mergekit's sort picks
  among them arbitrarily, dghard takes them in a documented order;
- random methods (dare_*, della*): the drop masks come from different random streams by
  design, so entries differ; the script also prints the relative difference of the merged
  task vector's norm ‖W − W_base‖ over the whole model (same distribution: close to 0).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MERGEKIT = "mergekit==0.1.5"
TORCH = "torch==2.13.0"

ALL_METHODS = (
    "linear", "task_arithmetic", "ties", "dare_linear", "dare_ties", "breadcrumbs", "breadcrumbs_ties",
    "della", "della_linear", "slerp", "slerp_gradient", "model_stock",
)  # fmt: skip
RANDOM = {"dare_linear", "dare_ties", "della", "della_linear"}


def venv_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    if os.environ.get("DGHARD_MERGEKIT_VENV"):
        return Path(os.environ["DGHARD_MERGEKIT_VENV"])
    return Path(tempfile.gettempdir()) / "dghard-mergekit-0.1.5"


def ensure_mergekit(venv: Path) -> Path:
    """The ``mergekit-yaml`` executable, installing mergekit 0.1.5 into ``venv`` if needed."""
    exe = venv / "bin" / "mergekit-yaml"
    if exe.exists():
        return exe
    print(f"installing {MERGEKIT} into {venv} (once) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, TORCH], check=True)  # the CPU build first: mergekit asks for torch>=2.0
    subprocess.run([*pip, MERGEKIT], check=True)
    if not exe.exists():
        raise SystemExit(f"{exe} is missing after installing {MERGEKIT}")
    return exe


def make_models(root: Path, args) -> tuple[Path, list[Path]]:
    from dghard_cli.testing.synthetic import ArchConfig, make_pair

    cfg = ArchConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128),
        vocab_size=args.vocab,
    )
    fts = []
    base = None
    for i in range(args.models):
        b, f = make_pair(root / f"m{i}", cfg, dtype="float32", ft_shards=2, seed=0, delta_seed=100 + i)
        base = base or b
        fts.append(f)
    assert base is not None
    return base, fts


def mergekit_recipe(method: str, base: Path, fts: list[Path], weights: list[float], args) -> str:
    """The mergekit recipe of one method, written as mergekit's examples write them."""
    if method == "slerp":
        return (
            f"merge_method: slerp\nbase_model: {base}\nmodels:\n  - model: {base}\n  - model: {fts[0]}\n"
            f"parameters:\n  t: {args.t}\ndtype: float32\n"
        )
    if method == "slerp_gradient":  # the usual Hub recipe: one slice, t by layer and by filter
        return (
            f"slices:\n  - sources:\n      - model: {base}\n        layer_range: [0, {args.layers}]\n"
            f"      - model: {fts[0]}\n        layer_range: [0, {args.layers}]\n"
            f"merge_method: slerp\nbase_model: {base}\nparameters:\n  t:\n"
            "    - filter: self_attn\n      value: [0, 0.5, 0.3, 0.7, 1]\n"
            "    - filter: mlp\n      value: [1, 0.5, 0.7, 0.3, 0]\n    - value: 0.5\ndtype: float32\n"
        )
    if method == "model_stock":
        models = "".join(f"  - model: {f}\n" for f in fts)
        return f"merge_method: model_stock\nbase_model: {base}\nmodels:\n{models}dtype: float32\n"
    if method == "linear":  # BASE and the fine-tunes, averaged with weights
        ws = [0.5, *(0.5 * w / sum(weights) for w in weights)]
        models = "".join(
            f"  - model: {m}\n    parameters:\n      weight: {w}\n"
            for m, w in zip([base, *fts], ws, strict=True)
        )
        return f"merge_method: linear\nmodels:\n{models}dtype: float32\n"
    per_model = ["weight: {w}"]
    top = [f"lambda: {args.lam}"]
    if method != "task_arithmetic":
        density = {"ties": args.density, "breadcrumbs": args.bc_density, "breadcrumbs_ties": args.bc_density}
        per_model.append(f"density: {density.get(method, args.dare_density)}")
    if method.startswith("breadcrumbs"):
        per_model.append(f"gamma: {args.gamma}")
    if method.startswith("della"):
        per_model.append(f"epsilon: {args.epsilon}")
    if method in ("ties", "della"):
        top.append("normalize: true")
    if method in ("ties", "dare_ties", "breadcrumbs_ties", "della"):
        top.append("int8_mask: true")
    lines = [f"merge_method: {method}", f"base_model: {base}", "models:", f"  - model: {base}"]
    for f, w in zip(fts, weights, strict=True):
        lines.append(f"  - model: {f}")
        lines.append("    parameters:")
        lines += [f"      {p.format(w=w)}" for p in per_model]
    lines.append("parameters:")
    lines += [f"  {p}" for p in top]
    lines.append("dtype: float32")
    return "\n".join(lines) + "\n"


#: Runs a command and prints its wall time and peak RSS. A separate small process: a child forked
#: from this script would count this script's own memory (Linux records the pre-exec RSS).
_MEASURE = r"""
import resource, subprocess, sys, time
t0 = time.perf_counter()
r = subprocess.run(sys.argv[1:], capture_output=True)
dt = time.perf_counter() - t0
if r.returncode:
    sys.stderr.buffer.write(r.stdout[-4000:] + r.stderr[-4000:])
print(dt, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
sys.exit(r.returncode)
"""


def measured(cmd: list[str], env: dict) -> tuple[float, float]:
    """(wall seconds, peak RSS bytes) of one command run in a fresh process."""
    r = subprocess.run([sys.executable, "-c", _MEASURE, *cmd], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stderr[-8000:])
        raise SystemExit(f"command failed ({r.returncode}): {' '.join(cmd)}")
    dt, rss = r.stdout.split()[-2:]
    return float(dt), float(rss)


def load(path: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def threshold_counts(method: str, numel: int, args) -> list[int]:
    """The top-k counts whose threshold decides a pruning method's mask (mergekit's definitions)."""
    if method == "ties":
        return [max(1, int(args.density * numel))] if args.density < 1 else []
    if method.startswith("breadcrumbs") and args.bc_density < 1:
        keep = int(args.bc_density * numel)
        dropped = numel - max(0, numel - keep - int(args.gamma * numel)) - keep
        return [k for k in (dropped, dropped + keep) if 0 < k < numel]
    return []


def ambiguous_positions(base, fts, ks: list[int]):
    """Entries where mergekit's choice is arbitrary: ties at a top-k threshold in its float32.

    mergekit ranks |Δ| (float32) with an unstable full sort, so among entries whose magnitude
    equals the k-th largest, which ones it keeps is unspecified (measured: neither the first
    nor the last in row-major order). dghard keeps them in the order of their exact float64
    magnitude, then row-major. Selection is per entry, so those entries are the only ones
    where the two outputs may differ beyond rounding.
    """
    import torch

    amb = torch.zeros(base.shape, dtype=torch.bool)
    n = base.numel()
    for f in fts:
        a = (f.float() - base.float()).abs().reshape(-1)  # mergekit's working precision
        for k in ks:
            t = torch.kthvalue(a, n - k + 1).values
            eq = a == t
            if int(eq.sum()) > k - int((a > t).sum()):
                amb |= eq.reshape(base.shape)
    return amb


def compare(a_dir: Path, b_dir: Path, base_dir: Path, ft_dirs: list[Path], ties_density: float | None):
    """TIES (``ties_density``) or exact methods (None): (worst relative error, its tensor, tensors,
    entries left out as ties at mergekit's threshold, how many of them differ)."""
    args = argparse.Namespace(density=ties_density if ties_density is not None else 1.0)
    r = compare_method(
        "ties" if ties_density is not None else "task_arithmetic", a_dir, b_dir, base_dir, ft_dirs, args
    )
    return r["rel"], r["where"], r["tensors"], r["left_out"], r["differing"]


def compare_method(method: str, a_dir: Path, b_dir: Path, base_dir: Path, ft_dirs: list[Path], args) -> dict:
    """Every tensor of dghard's output (``a_dir``) against mergekit's (``b_dir``)."""
    import torch

    a, b = load(a_dir), load(b_dir)
    if set(a) != set(b):
        raise SystemExit(f"{method}: tensor names differ: {sorted(set(a) ^ set(b))[:5]}")
    pruned = method == "ties" or method.startswith("breadcrumbs")
    need_inputs = pruned or method in RANDOM
    base = load(base_dir) if need_inputs else {}
    fts = [load(d) for d in ft_dirs] if pruned else []
    res = {"rel": 0.0, "abs": 0.0, "where": "", "tensors": len(a), "left_out": 0, "differing": 0, "norm": 0.0}
    sq = [0.0, 0.0]  # ‖W − W_base‖² over the model, dghard's and mergekit's (random methods)
    for name in sorted(a):
        x, y = a[name].to(torch.float64), b[name].to(torch.float64)
        if method in RANDOM:
            b0 = base[name].to(torch.float64)
            sq[0] += float(torch.linalg.vector_norm(x - b0)) ** 2
            sq[1] += float(torch.linalg.vector_norm(y - b0)) ** 2
        if pruned:
            ks = threshold_counts(method, base[name].numel(), args)
            amb = ambiguous_positions(base[name], [f[name] for f in fts], ks) if ks else None
            if amb is not None and bool(amb.any()):
                res["left_out"] += int(amb.sum())
                res["differing"] += int((x[amb] != y[amb]).sum())
                x, y = x[~amb], y[~amb]
        d = (x - y).abs()
        res["abs"] = max(res["abs"], float(d.max()) if d.numel() else 0.0)
        e = float(torch.linalg.vector_norm(x - y)) / (float(torch.linalg.vector_norm(y)) or 1.0)
        if e > res["rel"]:
            res["rel"], res["where"] = e, name
    if method in RANDOM:
        res["norm"] = abs(sq[0] ** 0.5 - sq[1] ** 0.5) / (sq[1] ** 0.5 or 1.0)
    if method == "slerp":  # mergekit sums the dot product in float32: measure both against float64
        base, ft = load(base_dir), load(ft_dirs[0])
        res["ref"] = [0.0, 0.0]
        for name in sorted(a):
            ref = slerp64(base[name].to(torch.float64), ft[name].to(torch.float64), args.t)
            den = float(torch.linalg.vector_norm(ref)) or 1.0
            for j, out in enumerate((a[name], b[name])):
                e = float(torch.linalg.vector_norm(out.to(torch.float64) - ref)) / den
                res["ref"][j] = max(res["ref"][j], e)
    return res


def slerp64(a, b, t: float):
    """mergekit's SLERP definition, evaluated in float64."""
    import math

    import torch

    na, nb = float(torch.linalg.vector_norm(a)), float(torch.linalg.vector_norm(b))
    na, nb = (na if na > 1e-8 else 1.0), (nb if nb > 1e-8 else 1.0)
    cos = min(1.0, max(-1.0, float((a.reshape(-1) / na) @ (b.reshape(-1) / nb))))
    if abs(cos) > 0.9995:
        return (1 - t) * a + t * b
    th = math.acos(cos)
    return (math.sin((1 - t) * th) * a + math.sin(t * th) * b) / math.sin(th)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--methods", default=",".join(ALL_METHODS), help=f"comma-separated, of: {', '.join(ALL_METHODS)}"
    )
    ap.add_argument("--models", type=int, default=2, help="number of fine-tunes (2 or more)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--density", type=float, default=0.2, help="ties")
    ap.add_argument("--dare-density", type=float, default=0.5, help="dare_*, della*")
    ap.add_argument("--bc-density", type=float, default=0.8, help="breadcrumbs*")
    ap.add_argument("--gamma", type=float, default=0.05, help="breadcrumbs*")
    ap.add_argument("--epsilon", type=float, default=0.1, help="della*")
    ap.add_argument("--t", type=float, default=0.35, help="slerp")
    ap.add_argument("--lam", type=float, default=1.0)
    ap.add_argument("--weights", default=None, help="comma-separated, one per fine-tune (default 1 each)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per tool; the fastest is reported")
    ap.add_argument("--venv", default=None)
    ap.add_argument("--workdir", default=None, help="keep the models, recipes and outputs here")
    args = ap.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in ALL_METHODS]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; choose from {', '.join(ALL_METHODS)}")

    exe = ensure_mergekit(venv_dir(args.venv))
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="dghard-vs-mergekit-"))
    work.mkdir(parents=True, exist_ok=True)
    weights = [float(x) for x in args.weights.split(",")] if args.weights else [1.0] * args.models
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(REPO))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    try:
        t0 = time.perf_counter()
        base, fts = make_models(work / "models", args)
        params = sum(p.stat().st_size for p in base.glob("*.safetensors")) // 4
        print(
            f"models: base + {len(fts)} fine-tunes, {params / 1e6:.1f} M parameters each, float32 "
            f"(generated in {time.perf_counter() - t0:.1f} s); {os.cpu_count()} CPU cores"
        )
        rows = []
        failed = False
        for method in methods:
            recipe = work / f"{method}.yml"
            recipe.write_text(mergekit_recipe(method, base, fts, weights, args))
            mk_out, dg_out = work / f"mergekit-{method}", work / f"dghard-{method}"
            mk_cmd = [str(exe), str(recipe), str(mk_out), "--no-cuda", "--quiet", "--no-copy-tokenizer"]
            dg_cmd = [
                sys.executable, "-m", "dghard_cli", "merge", "--config", str(recipe), "--out", str(dg_out),
                "--device", "cpu", "--quiet", "--overwrite",
            ]  # fmt: skip
            mk_runs, dg_runs = [], []
            for _ in range(args.repeat):  # interleaved: both see the same machine load
                shutil.rmtree(mk_out, ignore_errors=True)
                mk_runs.append(measured(mk_cmd, env))
                shutil.rmtree(dg_out, ignore_errors=True)
                dg_runs.append(measured(dg_cmd, env))
            used = fts[:1] if method.startswith("slerp") else fts
            r = compare_method(method, dg_out, mk_out, base, used, args)
            if method == "slerp":  # dghard against the float64 definition (mergekit's own error is larger)
                failed |= r["ref"][0] > 1e-6
            elif method == "slerp_gradient":  # mergekit's float32 dot product: see slerp's line
                failed |= r["rel"] > 1e-5
            elif method not in RANDOM:
                failed |= r["rel"] > 1e-6
            mk_t, mk_rss = min(t for t, _ in mk_runs), max(m for _, m in mk_runs)
            dg_t, dg_rss = min(t for t, _ in dg_runs), max(m for _, m in dg_runs)
            rows.append((method, mk_t, dg_t, mk_rss, dg_rss, r))
            print(f"  {method}: mergekit {mk_t:.1f} s, dghard {dg_t:.1f} s", flush=True)
        print()
        head = (
            f"{'method':<17} {'mergekit s':>10} {'dghard s':>9} {'time ratio':>10} {'mergekit MiB':>12} "
            f"{'dghard MiB':>10} {'RSS ratio':>9} {'max |diff|':>10} {'max rel err':>11}  note"
        )
        print(head)
        for method, mk_t, dg_t, mk_rss, dg_rss, r in rows:
            if method in RANDOM:
                note = f"random masks differ by design; merged task-vector norms differ by {100 * r['norm']:.2f} %"
            elif method == "slerp":
                note = (
                    f"vs a float64 evaluation: dghard {r['ref'][0]:.1e}, mergekit {r['ref'][1]:.1e} "
                    "(its float32 dot product)"
                )
            elif method == "slerp_gradient":
                note = (
                    "t per layer and filter (one slice over every layer); differences: mergekit's float32 dot"
                )
            elif r["left_out"]:
                note = (
                    f"{r['left_out']} entries tied at mergekit's threshold left out ({r['differing']} differ)"
                )
            else:
                note = ""
            print(
                f"{method:<17} {mk_t:>10.2f} {dg_t:>9.2f} {dg_t / mk_t:>10.2f} {mk_rss / 2**20:>12.0f} "
                f"{dg_rss / 2**20:>10.0f} {dg_rss / mk_rss:>9.2f} {r['abs']:>10.2e} {r['rel']:>11.2e}  {note}"
            )
        print(
            f"\n(time ratio = dghard / mergekit wall time, best of {args.repeat}, start-up included; "
            "RSS ratio = dghard / mergekit peak RSS; same machine, same inputs, same recipe, CPU)"
        )
        return 1 if failed else 0
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
