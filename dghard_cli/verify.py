"""Checking a written model directory: headers, index, expected tensors, finite values."""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import Checkpoint
from .errors import InputError
from .pipeline import row_ranges
from .safetensors_format import FLOAT_DTYPES


def verify_dir(
    path: Path,
    *,
    expected: dict[str, tuple[str, tuple[int, ...]]] | None = None,
    deep: bool = False,
) -> dict:
    """Verify a model directory; raises InputError naming the first problem.

    Always: every shard header parses and is consistent (offsets cover the data exactly), the
    index lists every tensor once and in the shard that holds it, and (when given) the tensor
    set, dtypes and shapes are the expected ones. ``deep``: every floating tensor is read and
    checked for NaN/Inf, and each shard is opened with the reference ``safetensors`` library.
    """
    ckpt = Checkpoint(Path(path), label="output")
    try:
        if expected is not None:
            missing = [n for n in expected if n not in ckpt.tensors]
            extra = [n for n in ckpt.tensors if n not in expected]
            if missing or extra:
                name = (missing or extra)[0]
                raise InputError(f"{path}: tensor {name!r} is {'missing' if missing else 'unexpected'}")
            for n, (dtype, shape) in expected.items():
                t = ckpt.tensors[n]
                if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                    raise InputError(
                        f"{path}: tensor {n!r} is {t.dtype}{list(t.shape)}, expected {dtype}{list(shape)}"
                    )
        nonfinite = 0
        if deep:
            from safetensors import safe_open

            for shard in ckpt.shards:
                with safe_open(str(Path(path) / shard), framework="pt") as fh:
                    keys = set(fh.keys())
                held = {n for n, t in ckpt.tensors.items() if t.shard == shard}
                if keys != held:
                    raise InputError(f"{path / shard}: the safetensors library sees other tensors")
            for name, info in ckpt.tensors.items():
                if info.dtype not in FLOAT_DTYPES:
                    continue
                for rows in row_ranges(info, 64 * 1024 * 1024):
                    if not bool(torch.isfinite(info.read(rows)).all()):
                        raise InputError(f"{path}: tensor {name!r} contains NaN or Inf")
        return {
            "path": str(path),
            "shards": len(ckpt.shards),
            "tensors": len(ckpt.tensors),
            "bytes": ckpt.total_bytes,
            "index": ckpt.index_file is not None,
            "deep": deep,
            "nonfinite_tensors": nonfinite,
        }
    finally:
        ckpt.close()
