"""Where checkpoints come from: a local directory or a Hugging Face Hub id.

Hub ids (``org/name``) are resolved with ``huggingface_hub.snapshot_download`` restricted to
weight, config and tokenizer files; ``--revision``, ``HF_HUB_OFFLINE`` and the local cache are
honoured. Pickle weights are never downloaded.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from dghard_cli.errors import InputError
from dghard_cli.io.checkpoint import Checkpoint, path_exists

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")

#: Files fetched from the Hub: weights, configs, tokenizers, chat templates. Never pickles.
HUB_PATTERNS = [
    "*.safetensors",
    "*.safetensors.index.json",
    "*.json",
    "*.txt",
    "*.model",
    "*.jinja",
    "*.tiktoken",
    "tokenizer*",
    "vocab*",
    "merges*",
]


def is_hub_id(spec: str) -> bool:
    """True for a well-formed ``org/name`` (no ``..``, no absolute path)."""
    return bool(HUB_ID.match(spec)) and ".." not in spec


def resolve_dir(spec: str, *, revision: str | None = None, label: str = "checkpoint") -> Path:
    """A local directory for ``spec``: the path itself, or a Hub snapshot."""
    path = Path(spec).expanduser()
    if path_exists(path):
        return path
    if spec.startswith((".", "/", "~")) or not is_hub_id(spec):
        raise InputError(
            f"{label} {spec}: no such directory, and not a Hugging Face Hub id of the form org/name"
        )
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency
        raise InputError("huggingface_hub is not installed; pass a local directory") from None
    try:
        local = snapshot_download(spec, revision=revision, allow_patterns=HUB_PATTERNS)
    except Exception as exc:  # network, auth, offline cache miss: all user-facing
        if hub_offline():
            at = f" at revision {revision}" if revision else ""
            raise InputError(
                f"{label} {spec}: not a local directory, and the local Hub cache ({hub_cache()}) "
                f"does not hold it{at}; HF_HUB_OFFLINE is set, so nothing is downloaded",
                hint="check the id and --revision, download it once with network access and "
                "HF_HUB_OFFLINE unset, or point HF_HUB_CACHE at the cache that holds it",
            ) from None
        kind = type(exc).__name__
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else kind
        raise InputError(
            f"{label} {spec}: not a local directory and the Hub download failed ({kind}: {first})",
            hint="check the id, --revision and the network, and HF_TOKEN for a private model; "
            "without a network, set HF_HUB_OFFLINE=1 to use the local cache",
        ) from None
    return Path(local)


def hub_offline() -> bool:
    """huggingface_hub's offline mode, read from the environment as it reads it
    (``HF_HUB_OFFLINE``, else ``TRANSFORMERS_OFFLINE``; 1, ON, YES or TRUE)."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return value is not None and value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_cache() -> str:
    """The Hub cache directory huggingface_hub uses (``HF_HUB_CACHE``, else under ``HF_HOME``)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency
        return "~/.cache/huggingface/hub"
    return str(constants.HF_HUB_CACHE)


def open_checkpoint(spec: str, *, revision: str | None = None, label: str = "checkpoint") -> Checkpoint:
    """Resolve ``spec`` (directory or Hub id) and open it as a validated checkpoint."""
    path = resolve_dir(spec, revision=revision, label=label)
    return Checkpoint(path, label=label, source=spec, revision=revision)
