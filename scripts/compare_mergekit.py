#!/usr/bin/env python3
"""Run `dghard merge` and `mergekit-yaml` (mergekit 0.1.5) on the same generated models with the
same method and parameters; compare every tensor and print the wall times and their ratio.

    python scripts/compare_mergekit.py                       # task-arithmetic and ties, 2 fine-tunes
    python scripts/compare_mergekit.py --models 3 --hidden 896 --intermediate 4864 --layers 4

mergekit 0.1.5 is installed from PyPI into its own virtual environment the first time (torch
2.13.0 first, so pip takes the CPU build instead of pulling a CUDA one; mergekit 0.1.5 only
asks for torch>=2.0). The environment lives in the system temp directory
(``<tmp>/dghard-mergekit-0.1.5``) or where ``--venv`` / ``DGHARD_MERGEKIT_VENV`` say; it is never
part of the repository. Both tools run offline, on CPU (mergekit without ``--cuda``), on
float32 checkpoints with a ``config.json`` that the script writes with ``dghard_cli.testing.synthetic``.

Parameter mapping (same numbers, both sides):

    dghard merge --method task-arithmetic --weights w1,w2 --lambda L
      == mergekit merge_method: task_arithmetic, parameters.weight: w_i per model, lambda: L
         (normalize defaults to false there)
    dghard merge --method ties --density D --weights w1,w2 --lambda L
      == mergekit merge_method: ties, parameters.weight: w_i and density: D per model,
         normalize: true (its default: the disjoint *mean*), lambda: L; int8_mask only
         changes the dtype of mergekit's mask, not the result.

Exit status 1 if any tensor differs by more than 1e-6 (relative Frobenius error).
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


def mergekit_config(
    method: str, base: Path, fts: list[Path], weights: list[float], density: float, lam: float
) -> str:
    lines = [f"merge_method: {method.replace('-', '_')}", f"base_model: {base}", "models:"]
    for f, w in zip(fts, weights, strict=True):
        lines.append(f"  - model: {f}")
        lines.append("    parameters:")
        lines.append(f"      weight: {w}")
        if method == "ties":
            lines.append(f"      density: {density}")
    lines.append("parameters:")
    lines.append(f"  lambda: {lam}")
    if method == "ties":
        lines.append("  normalize: true")
    lines.append("dtype: float32")
    return "\n".join(lines) + "\n"


def timed(cmd: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if res.returncode != 0:
        sys.stderr.write(res.stdout[-4000:] + res.stderr[-4000:])
        raise SystemExit(f"command failed ({res.returncode}): {' '.join(cmd)}")
    return dt


def load(path: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def ambiguous_positions(base, fts, density: float):
    """Entries where mergekit's TIES choice is arbitrary: ties at its float32 top-k threshold.

    mergekit ranks |Δ| (float32) with an unstable full sort, so among entries whose magnitude
    equals the k-th largest, which ones it keeps is unspecified (measured: neither the first
    nor the last in row-major order). dghard keeps the first ones in row-major order (after
    ranking them by their exact float64 magnitude). Selection is per entry, so those entries
    are the only ones where the two outputs may differ beyond rounding.
    """
    import torch

    amb = torch.zeros(base.shape, dtype=torch.bool)
    n = base.numel()
    k = max(1, int(density * n)) if density < 1 else n
    for f in fts:
        a = (f.float() - base.float()).abs().reshape(-1)  # mergekit's working precision
        if k >= n:
            continue
        t = torch.kthvalue(a, n - k + 1).values
        eq = a == t
        if int(eq.sum()) > k - int((a > t).sum()):
            amb |= eq.reshape(base.shape)
    return amb


def compare(a_dir: Path, b_dir: Path, base_dir: Path, ft_dirs: list[Path], ties_density: float | None):
    """Worst relative error over every tensor (leaving out ties at mergekit's TIES threshold)."""
    import torch

    a, b = load(a_dir), load(b_dir)
    if set(a) != set(b):
        raise SystemExit(f"tensor names differ: {sorted(set(a) ^ set(b))[:5]}")
    base = load(base_dir) if ties_density is not None else {}
    fts = [load(d) for d in ft_dirs] if ties_density is not None else []
    worst, where, left_out, differing = 0.0, "", 0, 0
    for name in sorted(a):
        x, y = a[name].to(torch.float64), b[name].to(torch.float64)
        if ties_density is not None:
            amb = ambiguous_positions(base[name], [f[name] for f in fts], ties_density)
            if bool(amb.any()):
                left_out += int(amb.sum())
                differing += int((x[amb] != y[amb]).sum())
                x, y = x[~amb], y[~amb]
        den = float(torch.linalg.vector_norm(y)) or 1.0
        e = float(torch.linalg.vector_norm(x - y)) / den
        if e > worst:
            worst, where = e, name
    return worst, where, len(a), left_out, differing


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="task-arithmetic,ties")
    ap.add_argument("--models", type=int, default=2, help="number of fine-tunes (2 or more)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--density", type=float, default=0.2)
    ap.add_argument("--lam", type=float, default=1.0)
    ap.add_argument("--weights", default=None, help="comma-separated, one per fine-tune (default 1 each)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per tool; the fastest is reported")
    ap.add_argument("--venv", default=None)
    ap.add_argument("--workdir", default=None, help="keep the models and outputs here")
    args = ap.parse_args()

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
            f"(generated in {time.perf_counter() - t0:.1f} s)"
        )
        rows = []
        failed = False
        for method in args.methods.split(","):
            cfg = work / f"{method}.yaml"
            cfg.write_text(mergekit_config(method, base, fts, weights, args.density, args.lam))
            mk_out, dg_out = work / f"mergekit-{method}", work / f"dghard-{method}"
            mk_cmd = [str(exe), str(cfg), str(mk_out), "--no-cuda", "--quiet", "--no-copy-tokenizer"]
            dg_cmd = [
                sys.executable, "-m", "dghard_cli", "merge", "--method", method, str(base), *map(str, fts),
                "--out", str(dg_out), "--weights", ",".join(map(str, weights)), "--lambda", str(args.lam),
                "--device", "cpu", "--quiet", "--overwrite",
            ]  # fmt: skip
            if method == "ties":
                dg_cmd += ["--density", str(args.density)]
            mk_t, dg_t = [], []
            for _ in range(args.repeat):
                shutil.rmtree(mk_out, ignore_errors=True)
                mk_t.append(timed(mk_cmd, env))
                shutil.rmtree(dg_out, ignore_errors=True)
                dg_t.append(timed(dg_cmd, env))
            worst, where, n, left_out, differing = compare(
                dg_out, mk_out, base, fts, args.density if method == "ties" else None
            )
            failed |= worst > 1e-6
            rows.append((method, min(mk_t), min(dg_t), worst, where, n, left_out, differing))
        print()
        print(
            f"{'method':<16} {'mergekit 0.1.5':>15} {'dghard':>10} {'speed-up':>9} {'max rel. error':>15}  tensors"
        )
        for method, mk, dg, worst, where, n, *_ in rows:
            print(
                f"{method:<16} {mk:>13.2f} s {dg:>8.2f} s {mk / dg:>8.2f}x {worst:>15.2e}  {n} (worst: {where})"
            )
        print(f"\n(wall time of each command, best of {args.repeat}; same machine, same inputs, CPU)")
        for method, *_, left_out, differing in rows:
            if left_out:
                print(
                    f"{method}: {left_out} entries tie exactly at mergekit's top-k threshold; its unstable "
                    f"sort picks among them arbitrarily, so they are left out of the error "
                    f"({differing} of them differ)"
                )
        return 1 if failed else 0
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
