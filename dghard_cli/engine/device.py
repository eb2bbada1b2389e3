"""``--device auto|cpu|cuda|cuda:N``."""

from __future__ import annotations

import re

import torch

from dghard_cli.errors import InputError


def resolve_device(spec: str = "auto") -> torch.device:
    """The torch device for a ``--device`` value; auto = first CUDA device if present."""
    s = (spec or "auto").strip().lower()
    if s == "auto":
        return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
    if s == "cpu":
        return torch.device("cpu")
    m = re.fullmatch(r"cuda(?::(\d+))?", s)
    if not m:
        raise InputError(f"--device {spec!r} is not one of auto, cpu, cuda, cuda:N")
    if not torch.cuda.is_available():
        raise InputError(f"--device {spec}: no CUDA device is available here; use --device cpu")
    index = int(m.group(1) or 0)
    if index >= torch.cuda.device_count():
        raise InputError(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return torch.device(f"cuda:{index}")
