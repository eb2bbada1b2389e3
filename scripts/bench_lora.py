#!/usr/bin/env python3
"""A DG-Hard repair written as a PEFT LoRA adapter vs the full checkpoint, on the bench pair.

The pair is ``scripts/bench_cpu.py``'s Qwen2.5-0.5B-shaped one (hidden 896, intermediate 4864,
24 layers, vocabulary 151936, tied embeddings, bf16, 2 shards; the fine-tune is the base plus a
rank-8 signal and i.i.d. noise on every matrix), generated once in ``--workdir``. Runs, each in
its own process under ``/usr/bin/time -v``:

- ``dghard repair BASE FT FULL``                (the full repaired checkpoint)
- ``dghard repair BASE FT ADAPTER --format peft`` (the same repair as an adapter)

and prints wall time, peak RSS, bytes on disk and their ratio, then checks the adapter against
the full repair tensor by tensor: ``W_base + B·A`` (or the adapter's full tensor) against the
full output, relative to the repair's update ‖W_full − W_base‖ (the full output is bf16, so the
difference is the full output's bf16 rounding; the adapter's factors are float32).

    python scripts/bench_lora.py                     # 24 layers, ~2 GB on disk
    python scripts/bench_lora.py --layers 4
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


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir() if p.is_file())


def weights_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.glob("*.safetensors"))


def check(base: Path, full: Path, adapter: Path) -> dict:
    """Largest relative difference between BASE + adapter and the full repair, per tensor."""
    import torch
    from safetensors.torch import load_file

    def load(d: Path) -> dict:
        out = {}
        for p in sorted(d.glob("*.safetensors")):
            out.update(load_file(str(p)))
        return out

    wb, wf = load(base), load(full)
    sd = load_file(str(adapter / "adapter_model.safetensors"))
    pre = "base_model.model."
    worst, n = 0.0, 0
    for name, w_full in wf.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        w0 = wb[name].double()
        if module and f"{pre}{module}.lora_A.weight" in sd:
            w = w0 + sd[f"{pre}{module}.lora_B.weight"].double() @ sd[f"{pre}{module}.lora_A.weight"].double()
        elif module and f"{pre}{module}.lora_embedding_A" in sd:
            w = (
                w0
                + (
                    sd[f"{pre}{module}.lora_embedding_B"].double()
                    @ sd[f"{pre}{module}.lora_embedding_A"].double()
                ).T
            )
        elif f"{pre}{name}" in sd:
            w = sd[f"{pre}{name}"].double()
        elif name.rsplit(".", 1)[0] + ".base_layer." + name.rsplit(".", 1)[1] in {k[len(pre) :] for k in sd}:
            w = sd[pre + name.rsplit(".", 1)[0] + ".base_layer." + name.rsplit(".", 1)[1]].double()
        else:
            w = w0
        upd = float(torch.linalg.norm(w_full.double() - w0)) or 1.0
        worst = max(worst, float(torch.linalg.norm(w.to(w_full.dtype).double() - w_full.double())) / upd)
        n += 1
    return {"tensors": n, "max_rel_diff": worst}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "dghard-bench-cpu")
    ap.add_argument("--layers", type=int, default=24)
    args = ap.parse_args()
    from dghard_cli.testing.synthetic import DeltaModel, make_pair

    work = (
        args.workdir if args.layers == 24 else args.workdir.with_name(args.workdir.name + f"-{args.layers}")
    )
    base, ft = work / "base", work / "ft"
    if not (ft / "model.safetensors.index.json").exists():
        print(f"generating a Qwen2.5-0.5B-shaped pair ({args.layers} layers) in {work} ...", flush=True)
        dm = DeltaModel(rank=8, signal=4.0, noise=1e-3, weight_std=0.02)
        make_pair(work, qwen05b(args.layers), dtype="bfloat16", base_shards=2, ft_shards=2, seed=0, delta=dm)
    full, adapter = work / "repaired-full", work / "repaired-peft"
    for d in (full, adapter):
        shutil.rmtree(d, ignore_errors=True)
    cli = [sys.executable, "-m", "dghard_cli", "repair", str(base), str(ft)]
    r_full = timed([*cli, str(full), "--device", "cpu", "--quiet"])
    r_peft = timed([*cli, str(adapter), "--format", "peft", "--device", "cpu", "--quiet"])
    doc = json.loads((adapter / "dghard_report.json").read_text())
    a = doc["adapter"]
    res = {
        "full": {
            "wall_s": round(r_full["wall_s"], 1),
            "peak_rss_mb": round(r_full["peak_rss_mb"]),
            "weights_bytes": weights_bytes(full),
        },
        "peft": {
            "wall_s": round(r_peft["wall_s"], 1),
            "peak_rss_mb": round(r_peft["peak_rss_mb"]),
            "weights_bytes": weights_bytes(adapter),
            "dir_bytes": dir_bytes(adapter),
            "lora_modules": a["lora_modules"],
            "full_tensors": a["full_tensors"],
            "rank_median": a["rank_median"],
            "rank_max": a["rank_max"],
            "energy_lost_max": a["energy_lost_max"],
        },
    }
    res["size_ratio"] = res["peft"]["weights_bytes"] / res["full"]["weights_bytes"]
    res["check"] = check(base, full, adapter)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
