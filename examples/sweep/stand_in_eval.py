#!/usr/bin/env python3
"""A stand-in evaluation for ``examples/tiny``, in the shape ``dghard sweep --eval`` expects.

    python examples/sweep/stand_in_eval.py MODEL_DIR OUTPUT_JSON

Real teams run lm-evaluation-harness (or their own suite) here. This script instead scores a
checkpoint of the tiny example from its weights, using what only the example's generator
knows, the planted task signal S of every matrix (``scripts/make_tiny_example.py``). With
D = W − W_base per matrix:

    p = Σ⟨D, S⟩ / Σ‖S‖²                    share of the task signal the model carries
    q = Σ‖(I − U Uᵀ) D‖² / (the same for FT)  update energy outside the signal's directions U

    task    = 40 + 40·p        (the fine-tune's skill: improved)
    general = 70 − 30·q        (damaged by the noise the fine-tune brought)
    math    = 60 − 20·√q       (damaged)
    chat    = 50 + 0.1·q       (unchanged)

It writes ``{"task": ..., "general": ..., "math": ..., "chat": ...}`` (points) to OUTPUT_JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from make_tiny_example import DELTA, SEED  # noqa: E402

from dghard_cli.testing.synthetic import signal_and_noise  # noqa: E402

EXAMPLE = REPO / "examples" / "tiny"


def load(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for p in sorted(Path(d).glob("*.safetensors")):
        out.update(load_file(str(p)))
    return out


def main() -> None:
    model, output = Path(sys.argv[1]), Path(sys.argv[2])
    b, f, m = load(EXAMPLE / "base"), load(EXAMPLE / "ft"), load(model)
    num = den = q = q0 = 0.0
    for name, wb in b.items():
        if wb.ndim != 2:
            continue
        s, _ = signal_and_noise(name, tuple(wb.shape), SEED, DELTA)
        u = torch.linalg.svd(s, full_matrices=False)[0][:, : DELTA.rank]
        d = m[name].double() - wb.double()
        df = f[name].double() - wb.double()
        num += float(torch.sum(d * s))
        den += float(torch.sum(s * s))
        q += float(torch.sum((d - u @ (u.T @ d)) ** 2))
        q0 += float(torch.sum((df - u @ (u.T @ df)) ** 2))
    p, q = num / den, q / q0
    scores = {"task": 40 + 40 * p, "general": 70 - 30 * q, "math": 60 - 20 * q**0.5, "chat": 50 + 0.1 * q}
    output.write_text(json.dumps(scores, indent=2) + "\n")


if __name__ == "__main__":
    main()
