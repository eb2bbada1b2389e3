"""Checking a written directory, whichever kind it is: a PEFT adapter directory (its config,
weights, report and, given ``base``, its fit to BASE: :mod:`dghard_cli.lora.verify`) or a full
checkpoint (headers, index, hashes, finite values: :mod:`dghard_cli.io.verify`). The one place
that tells the two apart, above both, so that ``io`` needs nothing from ``lora``."""

from __future__ import annotations

from pathlib import Path

from dghard_cli.io.checkpoint import Checkpoint
from dghard_cli.io.verify import verify_dir
from dghard_cli.lora.config import ADAPTER_CONFIG


def verify_directory(path: Path, *, deep: bool, base: Checkpoint | None = None) -> dict:
    """``dghard verify``'s checks of ``path`` against its own report; InputError names the first
    problem."""
    path = Path(path)
    if (path / ADAPTER_CONFIG).is_file():
        from dghard_cli.lora.verify import verify_adapter_dir

        return verify_adapter_dir(path, deep=deep, base=base)
    return verify_dir(path, deep=deep, use_report=True, base=base)
