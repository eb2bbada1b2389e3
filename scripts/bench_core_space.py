#!/usr/bin/env python3
"""LoRA experts merged in their core space (``merge --core-space``) against the other routes.

Three PEFT LoRA adapters (r = 16, α = 32, every linear module of every layer; random factors,
seeds 1–3) of the Qwen2.5-0.5B-shaped bf16 bench BASE (``scripts/bench_cpu.py``; generated once
in ``--workdir``). Each command runs in its own process under ``/usr/bin/time -v``:

- TIES (density 0.2) in the core space — an exact adapter of the cores' merge;
- TIES on the full tensors, written as an adapter cut to ``--rank 48`` (Σ r_i: lossy, reported);
- TIES on the full tensors, written as a full checkpoint (``--merge``);
- Iso-C in the core space and on the full tensors (factored with ``--rank 48``, the update's
  numerical rank, so exact): the same update, checked here module by module;
- task arithmetic in the core space and by the exact concatenation route.

It prints wall time, peak RSS and output size per command, and the largest relative difference
between the pairs that must agree.

    python scripts/bench_core_space.py                 # 24 layers
    python scripts/bench_core_space.py --layers 2
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_cpu import qwen05b, timed  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK, ALPHA = 16, 32


def make_base(work: Path, layers: int) -> Path:
    from dghard_cli.testing.synthetic import make_pair

    base = work / "base"
    if not (base / "config.json").exists():
        print(f"generating a Qwen2.5-0.5B-shaped BASE ({layers} layers) in {work} ...", flush=True)
        make_pair(work, qwen05b(layers), dtype="bfloat16", base_shards=2, ft_shards=1, seed=0)
        shutil.rmtree(work / "ft")  # only BASE is needed
    return base


def make_adapter(base: Path, out: Path, seed: int) -> Path:
    """A PEFT LoRA adapter of every linear module, written as PEFT saves one."""
    import torch
    from safetensors.torch import save_file

    if (out / "adapter_model.safetensors").exists():
        return out
    from dghard_cli.io.hub import open_checkpoint

    ck = open_checkpoint(str(base), label="BASE")
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, info in ck.tensors.items():
        module = name[: -len(".weight")]
        if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in TARGETS:
            continue
        m, n = info.shape
        a = torch.randn((RANK, n), generator=g) / n**0.5
        b = torch.randn((m, RANK), generator=g) * 0.02
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.to(torch.bfloat16)
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.to(torch.bfloat16)
    ck.close()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg = {
        "peft_type": "LORA",
        "base_model_name_or_path": str(base),
        "r": RANK,
        "lora_alpha": ALPHA,
        "target_modules": list(TARGETS),
        "lora_dropout": 0.0,
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }
    (out / "adapter_config.json").write_text(json.dumps(cfg, indent=1))
    return out


def deltas(d: Path) -> dict:
    """``{weight name: ΔW}`` of an adapter directory written by dghard (float64)."""
    import re

    from safetensors.torch import load_file

    cfg = json.loads((d / "adapter_config.json").read_text())
    t = load_file(str(d / "adapter_model.safetensors"))
    out = {}
    for k, a in t.items():
        if ".lora_A." not in k:
            continue
        module = k.split("base_model.model.", 1)[1].split(".lora_A.", 1)[0]
        b = t[k.replace(".lora_A.", ".lora_B.")].double()
        r = next(
            (v for p, v in (cfg.get("rank_pattern") or {}).items() if re.match(rf"(.*\.)?({p})$", module)),
            cfg["r"],
        )
        al = next(
            (v for p, v in (cfg.get("alpha_pattern") or {}).items() if re.match(rf"(.*\.)?({p})$", module)),
            cfg["lora_alpha"],
        )
        out[f"{module}.weight"] = (al / r) * (b @ a.double())
    return out


def worst_difference(a: Path, b: Path) -> float:
    import torch

    da, db = deltas(a), deltas(b)
    if set(da) != set(db):
        return float("inf")
    return max(float(torch.linalg.norm(da[k] - db[k]) / (torch.linalg.norm(db[k]) or 1.0)) for k in da)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "dghard-bench-core")
    ap.add_argument("--layers", type=int, default=24)
    args = ap.parse_args()
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    base = make_base(work, args.layers)
    ads = [str(make_adapter(base, work / f"adapter{i}", i)) for i in (1, 2, 3)]
    dg = [sys.executable, "-m", "dghard_cli", "merge"]
    runs = {
        "ties, core space": ["--method", "ties", "--core-space"],
        "ties, full tensors, --rank 48 adapter": ["--method", "ties", "--rank", str(3 * RANK)],
        "ties, full tensors, full checkpoint": ["--method", "ties", "--merge"],
        "iso-c, core space": ["--method", "iso-c", "--core-space"],
        "iso-c, full tensors, adapter": ["--method", "iso-c", "--rank", str(3 * RANK)],
        "task arithmetic, core space": ["--method", "task-arithmetic", "--core-space"],
        "task arithmetic, exact route": ["--method", "task-arithmetic"],
    }
    outs: dict[str, Path] = {}
    print(f"3 adapters, r = {RANK}, {len(TARGETS)} modules x {args.layers} layers; BASE {base}")
    print("| run | wall s | peak RSS MB | output MB | route | exact |")
    print("|---|---:|---:|---:|---|---|")
    for label, opts in runs.items():
        out = work / ("out-" + label.replace(" ", "-").replace(",", ""))
        shutil.rmtree(out, ignore_errors=True)
        r = timed([*dg, str(base), *ads, "--out", str(out), "--quiet", *opts])
        outs[label] = out
        size = sum(p.stat().st_size for p in out.glob("*.safetensors")) / 1e6
        rep = json.loads((out / "dghard_report.json").read_text())
        a = rep.get("adapter") or {}
        route = a.get("route", "full checkpoint")
        exact = a.get("exact", True)
        kept = "" if exact else f" (keeps {100 * a.get('energy_kept', 0):.1f} %)"
        print(
            f"| {label} | {r['wall_s']:.1f} | {r['peak_rss_mb']:.0f} | {size:.1f} | {route} | {exact}{kept} |",
            flush=True,
        )
    print()
    for x, y in (
        ("iso-c, core space", "iso-c, full tensors, adapter"),
        ("task arithmetic, core space", "task arithmetic, exact route"),
    ):
        print(
            f"{x} vs {y}: largest relative difference of a module's update {worst_difference(outs[x], outs[y]):.2e}"
        )


if __name__ == "__main__":
    main()
