"""Peak resident memory stays a small multiple of the largest tensor, not of the model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dghard_cli.testing.synthetic import write_checkpoint

REPO = Path(__file__).resolve().parent.parent

MEASURE = r"""
import resource, subprocess, sys
r = subprocess.run(sys.argv[1:], capture_output=True, text=True)
sys.stderr.write(r.stderr)
sys.stdout.write(r.stdout)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
sys.exit(r.returncode)
"""


def make_big_pair(
    root: Path, *, n_mats: int = 10, rows: int = 25_000, cols: int = 1_000
) -> tuple[Path, Path]:
    """~1 GB per checkpoint (float32), largest tensor 100 MB, three shards each."""
    g = torch.Generator().manual_seed(0)
    base, ft = [], []
    for i in range(n_mats):
        b = torch.randn(rows, cols, generator=g) * 0.02
        noise = torch.randn(rows, cols, generator=g) * 1e-3
        u = torch.randn(rows, 2, generator=g)
        v = torch.randn(2, cols, generator=g) * 0.01
        base.append((f"model.layers.{i}.mlp.up_proj.weight", b))
        ft.append((f"model.layers.{i}.mlp.up_proj.weight", b + noise + u @ v))
        base.append((f"model.layers.{i}.input_layernorm.weight", torch.ones(cols)))
        ft.append((f"model.layers.{i}.input_layernorm.weight", torch.ones(cols) * 1.01))
        del b, noise
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    write_checkpoint(root / "base", base, shards=3, config=cfg)
    write_checkpoint(root / "ft", ft, shards=3, config=cfg)
    return root / "base", root / "ft"


@pytest.mark.slow
def test_peak_rss_of_repair_on_a_1gb_pair_is_under_1gb(tmp_path):
    base, ft = make_big_pair(tmp_path)
    size = sum(p.stat().st_size for p in ft.glob("*.safetensors"))
    assert size > 0.95e9
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [
        sys.executable,
        "-c",
        MEASURE,
        sys.executable,
        "-m",
        "dghard_cli",
        "repair",
        str(base),
        str(ft),
        str(tmp_path / "out"),
        "--json",
        "--device",
        "cpu",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    peak = int(lines[-1])
    report = json.loads("\n".join(lines[:-1]))
    assert report["summary"]["method_tensors"] == 10
    print(f"checkpoint {size / 1e9:.2f} GB, peak RSS {peak / 2**20:.0f} MiB")
    assert peak < 1e9, f"peak RSS {peak / 2**20:.0f} MiB"
    assert report["peak_memory"]["rss_bytes"] <= peak * 1.05
