"""Checking a written model directory: headers, index, expected tensors, hashes, finite values."""

from __future__ import annotations

from pathlib import Path

import torch

from dghard_cli.errors import InputError
from dghard_cli.io.checkpoint import Checkpoint, read_json_file, row_ranges
from dghard_cli.io.files import REPORT_LIMIT
from dghard_cli.io.output import file_sha256
from dghard_cli.io.safetensors_format import FLOAT_DTYPES

REPORT_NAME = "dghard_report.json"


def verify_dir(
    path: Path,
    *,
    expected: dict[str, tuple[str, tuple[int, ...]]] | None = None,
    deep: bool = False,
    use_report: bool = False,
    base: Checkpoint | None = None,
) -> dict:
    """Verify a model directory; raises InputError naming the first problem.

    Always: every shard header parses and is consistent (offsets cover the data exactly), the
    index lists every tensor once and in the shard that holds it, and (when given) the tensor
    set, dtypes and shapes are the expected ones. ``use_report``: the same against the
    ``dghard_report.json`` in the directory, plus each shard's size and sha256 as recorded when
    it was written. ``deep``: every floating tensor is read and checked for NaN/Inf, and each
    shard is opened with the reference ``safetensors`` library.

    A PEFT adapter directory (``adapter_config.json``) is not a checkpoint: it is refused here
    and checked by :func:`dghard_cli.verification.verify_directory`, which tells the two apart.
    """
    path = Path(path)
    if (path / "adapter_config.json").is_file():
        raise InputError(f"{path}: a PEFT adapter directory, not a checkpoint; check it with `dghard verify`")
    if base is not None:
        raise InputError(
            f"{path}: --base checks an adapter directory against its base, and this is a full checkpoint"
        )
    ckpt = Checkpoint(path, label="output")
    checks = ["headers", "index"]
    try:
        files: list[dict] = []
        if use_report and (path / REPORT_NAME).exists():
            report = read_json_file(path / REPORT_NAME, "report", limit=REPORT_LIMIT, roots=ckpt.roots)
            try:
                recs = report["tensors"]
                files = list((report.get("output") or {}).get("files") or [])
                expected = expected or {r["name"]: (r["dtype"], tuple(r["shape"])) for r in recs}
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise InputError(f"{path / REPORT_NAME}: unreadable report ({exc})") from None
        if expected is not None:
            checks.append("tensor set, dtypes and shapes")
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
        if files:
            checks.append("shard sizes and sha256" if deep else "shard sizes (sha256 not checked: --quick)")
            for f in files:
                if not isinstance(f, dict) or f.get("name") not in ckpt.shards:
                    raise InputError(
                        f"{path / REPORT_NAME}: names a shard this directory does not hold ({f!r})"
                    )
                p = path / f["name"]
                if not p.exists():
                    raise InputError(f"{p}: shard recorded in the report is missing")
                if p.stat().st_size != f["size"]:
                    raise InputError(f"{p}: size {p.stat().st_size} differs from the recorded {f['size']}")
                if deep and file_sha256(p) != f["sha256"]:
                    raise InputError(f"{p}: sha256 differs from the one recorded when it was written")
        if deep:
            checks += ["safetensors library", "finite values"]
            from safetensors import safe_open

            for shard in ckpt.shards:
                with safe_open(str(path / shard), framework="pt") as fh:
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
            "ok": True,
            "shards": len(ckpt.shards),
            "tensors": len(ckpt.tensors),
            "bytes": ckpt.total_bytes,
            "index": ckpt.index_file is not None,
            "checks": checks,
            "skipped": [] if deep else ["sha256 of the shards", "safetensors library", "NaN/Inf scan"],
        }
    finally:
        ckpt.close()
