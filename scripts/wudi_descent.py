"""WUDI: dghard's closed form against the reference code's optimiser, on real task vectors.

For a few weight matrices of real experts (default: the real-model merge benchmark's four
experts of SmolLM2-135M-Instruct, ``scripts/real_merge_bench.py build WORK``; its weights are
dequantised from 4-bit Q4_1), the interference objective

    L(τ) = Σ_i ‖(τ − Δ_i)·Δ_iᵀ‖²_F / ‖Δ_i‖²_F

reached by:

- ``sum``: the task vectors' sum (task arithmetic at λ 1, both routes' starting point);
- ``dghard k``: ``dghard merge --method wudi --steps k``'s closed form (k plain gradient steps at
  step 1/(2·λ_max(A)), :mod:`dghard_cli.methods.wudi`), k = 300 (the default) and others;
- ``adam``: the reference code's optimiser, 300 Adam steps at lr 1e-5 from the sum (float32, as
  the authors' code runs it on a GPU);
- ``minimum``: the exact minimiser B·A⁺ (float64, numerical rank).

It prints L relative to L(sum), the relative distance of each result to Adam's, and the time of
each route per matrix (this machine's CPU threads).

    python scripts/wudi_descent.py WORK [--matrices q_proj,down_proj] [--layers 5,15,25]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from dghard_cli.methods.wudi import tall_kernels, wide_kernels

TASKS = ("licenses", "python", "dates", "numbers")


def load(d: Path, name: str) -> torch.Tensor:
    index = d / "model.safetensors.index.json"
    fname = json.loads(index.read_text())["weight_map"][name] if index.exists() else "model.safetensors"
    with safe_open(str(d / fname), "pt") as f:
        return f.get_tensor(name).to(torch.float64)


def objective(tau: torch.Tensor, taus: list[torch.Tensor]) -> float:
    return sum(float(torch.sum(((tau - t) @ t.T) ** 2) / torch.sum(t**2)) for t in taus)


def closed_form(taus: list[torch.Tensor], steps: int) -> torch.Tensor:
    if taus[0].shape[0] >= taus[0].shape[1]:
        ks, _ = tall_kernels([t.T @ t for t in taus], steps)
        return sum(t @ k for t, k in zip(taus, ks, strict=True))
    xs = [t.T for t in taus]
    cross = {(i, j): xs[i].T @ xs[j] for i in range(len(xs)) for j in range(i, len(xs))}
    ks, _ = wide_kernels(cross, len(xs), steps)
    return sum(x @ k for x, k in zip(xs, ks, strict=True)).T


def adam(taus: list[torch.Tensor], steps: int = 300, lr: float = 1e-5) -> torch.Tensor:
    """The reference code's loop (float32)."""
    vs = torch.stack([t.float() for t in taus])
    merged = torch.nn.Parameter(vs.sum(0))
    opt = torch.optim.Adam([merged], lr=lr, weight_decay=0)
    norms = vs.reshape(len(taus), -1).norm(dim=-1) ** 2
    for _ in range(steps):
        inner = torch.matmul(merged.unsqueeze(0) - vs, vs.transpose(1, 2))
        loss = torch.sum(inner**2 / norms[:, None, None])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return merged.detach().to(torch.float64)


def minimiser(taus: list[torch.Tensor]) -> torch.Tensor:
    c = [float(torch.sum(t**2)) for t in taus]
    a = sum(t.T @ t / ci for t, ci in zip(taus, c, strict=True))
    b = sum(t @ t.T @ t / ci for t, ci in zip(taus, c, strict=True))
    return b @ torch.linalg.pinv(a, hermitian=True, rtol=1e-12)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workdir")
    ap.add_argument("--matrices", default="self_attn.q_proj,mlp.down_proj")
    ap.add_argument("--layers", default="5,15,25")
    ap.add_argument("--steps", default="30,300,3000")
    args = ap.parse_args(argv)
    work = Path(args.workdir)
    base = work / "base"
    experts = [work / f"expert-{t}" for t in TASKS if (work / f"expert-{t}" / "config.json").is_file()]
    if not (base / "config.json").is_file() or len(experts) < 2:
        raise SystemExit(
            f"{work}: no base and experts; run `python scripts/real_merge_bench.py build {work}` first"
        )
    print(f"experts: {', '.join(e.name for e in experts)}")
    steps = [int(k) for k in args.steps.split(",")]
    print(f"torch threads: {torch.get_num_threads()}")
    print("| matrix | shape | " + " | ".join(f"L dghard {k}" for k in steps) + " | L adam | L minimum | "
          "‖dghard 300 − adam‖ / ‖adam‖ | time dghard 300 | time adam |")  # fmt: skip
    print("|---|---|" + "---:|" * (len(steps) + 5))
    for layer in args.layers.split(","):
        for kind in args.matrices.split(","):
            name = f"model.layers.{layer}.{kind}.weight"
            b = load(base, name)
            taus = [load(e, name) - b for e in experts]
            l0 = objective(sum(taus), taus)
            rel = {}
            for k in steps:
                rel[k] = objective(closed_form(taus, k), taus) / l0
            t0 = time.perf_counter()
            ours = closed_form(taus, 300)
            t_ours = time.perf_counter() - t0
            t0 = time.perf_counter()
            ref = adam(taus)
            t_adam = time.perf_counter() - t0
            l_adam = objective(ref, taus) / l0
            l_min = objective(minimiser(taus), taus) / l0
            dist = float(torch.linalg.norm(ours - ref) / torch.linalg.norm(ref))
            print(
                f"| {name} | {tuple(b.shape)} | "
                + " | ".join(f"{rel[k]:.3f}" for k in steps)
                + f" | {l_adam:.3f} | {l_min:.3f} | {dist:.3f} | {t_ours:.2f} s | {t_adam:.1f} s |",
                flush=True,
            )
    print("\nL is relative to L(Σ_i Δ_i), the starting point of both routes.")
    return 0


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    sys.exit(main())
