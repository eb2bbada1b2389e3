"""Benchmark `dghard audit-lora` on a 7B-shaped adapter (CPU).

Writes, in a temporary directory, a rank-16 PEFT adapter on all seven linear modules of every
layer of a real 7B/8B model shape (random factors, PEFT's names and config), then times:

* the audit without ``--base`` (library call, and the whole CLI process including start-up);
* the peer route a naive tool takes, measured in the same run on the first layer: form the dense
  ``scaling·B·A`` and take its singular values (extrapolated to all layers);
* optionally (``--base-layers N``) the audit with ``--base`` on the first N layers of a base with
  the real shapes (bf16), extrapolated to the whole model.

    python scripts/bench_audit.py                          # Qwen2.5-7B shapes, 28 layers
    python scripts/bench_audit.py --shape llama-3-8b --dtype bf16
    python scripts/bench_audit.py --base-layers 1          # also time the --base path
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dghard_cli.audit.auditor import audit_lora  # noqa: E402
from dghard_cli.testing.synthetic import ArchConfig, write_checkpoint  # noqa: E402
from dghard_cli.testing.synthetic_lora import (  # noqa: E402
    LINEAR_TARGETS,
    PREFIX,
    linear_modules,
    peft_config,
    write_adapter,
)

SHAPES = {
    "qwen2.5-7b": ArchConfig("qwen2", 3584, 18944, 28, 28, 4, 152064),
    "llama-3-8b": ArchConfig("llama", 4096, 14336, 32, 32, 8, 128256),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make(
    dir_: Path, arch: ArchConfig, r: int, dtype: torch.dtype, layers: int | None = None
) -> tuple[int, int]:
    g = torch.Generator().manual_seed(0)
    tensors = {}
    mods = linear_modules(arch, LINEAR_TARGETS)
    if layers is not None:
        mods = [m for m in mods if int(m[0].split(".")[2]) < layers]
    for module, out, inp in mods:
        tensors[f"{PREFIX}{module}.lora_A.weight"] = (torch.randn((r, inp), generator=g) / inp**0.5).to(dtype)
        tensors[f"{PREFIX}{module}.lora_B.weight"] = (torch.randn((out, r), generator=g) * 1e-3).to(dtype)
    cfg = peft_config(
        r=r, lora_alpha=2 * r, target_modules=list(LINEAR_TARGETS), base_model_name_or_path="bench-base"
    )
    write_adapter(dir_, tensors, cfg)
    return len(mods), sum(t.numel() * t.element_size() for t in tensors.values())


def peer_dense(dir_: Path, layer: int = 0) -> float:
    """Seconds for the naive route on one layer: dense scaling·B·A, then its singular values."""
    from safetensors.torch import load_file

    sd = load_file(str(dir_ / "adapter_model.safetensors"))
    t0 = time.perf_counter()
    for k in sd:
        if f".layers.{layer}." in k and k.endswith("lora_A.weight"):
            a = sd[k].float()
            b = sd[k.replace("lora_A", "lora_B")].float()
            torch.linalg.svdvals(2.0 * b @ a)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-7b")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument(
        "--peer-layers", type=int, default=1, help="layers timed on the dense peer route (0 skips)"
    )
    ap.add_argument("--base-layers", type=int, default=0, help="layers timed with --base (0 skips)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    arch = SHAPES[args.shape]
    dtype = DTYPES[args.dtype]
    res: dict = {
        "shape": args.shape,
        "layers": arch.num_hidden_layers,
        "rank": args.rank,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }
    with tempfile.TemporaryDirectory(prefix="dghard-bench-audit-") as tmp:
        ad = Path(tmp) / "adapter"
        t0 = time.perf_counter()
        n_mod, nbytes = make(ad, arch, args.rank, dtype)
        res.update(
            modules=n_mod, adapter_mb=round(nbytes / 1e6, 1), generate_s=round(time.perf_counter() - t0, 2)
        )

        audit_lora(str(ad))  # warm the page cache and torch's kernels once
        t0 = time.perf_counter()
        doc = audit_lora(str(ad))
        res["audit_s"] = round(time.perf_counter() - t0, 3)
        res["findings"] = doc["summary"]["codes"]

        env = dict(os.environ, PYTHONPATH=str(REPO))
        t0 = time.perf_counter()
        cli = subprocess.run(
            [sys.executable, "-m", "dghard_cli", "audit-lora", str(ad), "--json"],
            capture_output=True,
            text=True,
            env=env,
        )
        res["cli_s"] = round(time.perf_counter() - t0, 3)
        res["cli_exit"] = cli.returncode

        if args.peer_layers:
            per_layer = sum(peer_dense(ad, layer) for layer in range(args.peer_layers)) / args.peer_layers
            res["peer_dense_svd_s_extrapolated"] = round(per_layer * arch.num_hidden_layers, 1)
            res["speedup_vs_dense"] = round(per_layer * arch.num_hidden_layers / res["audit_s"], 1)

        if args.base_layers:
            n = args.base_layers
            base = Path(tmp) / "base"
            g = torch.Generator().manual_seed(1)
            weights = [
                (m + ".weight", (0.02 * torch.randn((o, i), generator=g)).to(torch.bfloat16))
                for m, o, i in linear_modules(arch, LINEAR_TARGETS)
                if int(m.split(".")[2]) < n
            ]
            write_checkpoint(base, weights, config=arch.to_hf("bfloat16"))
            del weights
            ad_n = Path(tmp) / "adapter_n"
            make(ad_n, arch, args.rank, dtype, layers=n)
            t0 = time.perf_counter()
            doc = audit_lora(str(ad_n), str(base), device="cpu")
            dt = time.perf_counter() - t0
            res["base_audit_s_per_layer"] = round(dt / n, 1)
            res["base_audit_s_extrapolated"] = round(dt / n * arch.num_hidden_layers, 0)
            res["base_timings"] = doc["timings"]

    if args.json:
        print(json.dumps(res, indent=2))
        return
    print(
        f"dghard audit-lora benchmark: {args.shape} shapes, {res['layers']} layers x 7 modules, rank {args.rank}, {args.dtype}"
    )
    print(f"  adapter: {res['modules']} modules, {res['adapter_mb']} MB (generated in {res['generate_s']} s)")
    print(f"  audit (library, no --base): {res['audit_s']:.2f} s   findings: {res['findings'] or 'none'}")
    print(f"  audit (whole CLI process):  {res['cli_s']:.2f} s   exit {res['cli_exit']}")
    if "peer_dense_svd_s_extrapolated" in res:
        print(
            f"  peer, dense scaling·B·A + svdvals: {res['peer_dense_svd_s_extrapolated']} s (from {args.peer_layers} "
            f"layer(s)) -> QR route is {res['speedup_vs_dense']}x faster"
        )
    if "base_audit_s_per_layer" in res:
        print(
            f"  with --base (cpu, bf16 base): {res['base_audit_s_per_layer']} s per layer -> "
            f"~{res['base_audit_s_extrapolated']:.0f} s for {res['layers']} layers"
        )
    print(f"  torch threads {res['threads']}, {res['cpu_count']} CPUs")


if __name__ == "__main__":
    main()
