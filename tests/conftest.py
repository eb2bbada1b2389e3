from __future__ import annotations

import os

# One BLAS thread pool at a time: the float64 references below use numpy (OpenBLAS), the
# package uses torch (OpenMP); both pools busy-waiting on 2 cores slow each other 50x.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parent.parent


def run_dghard(
    *args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Run the real command line in a subprocess (exit codes, stderr, no traceback)."""
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("HF_HUB_OFFLINE", "1")
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "dghard_cli", *map(str, args)],
        cwd=cwd,
        env=e,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def load_dir(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, loaded with the reference safetensors library."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            assert k not in out, f"{k} stored twice"
            out[k] = v
    return out


def f64(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float64).numpy()


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
