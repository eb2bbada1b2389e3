"""PEFT LoRA adapters on disk: the files, the config's semantics, the tensor names.

A PEFT adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors``
(older ones a pickle ``adapter_model.bin``, which is refused, never unpickled). Tensor names are
the PEFT model's parameter names with the adapter name removed::

    base_model.model.<module>.lora_A.weight          r x in        (Linear; Conv: r x in x kh x kw)
    base_model.model.<module>.lora_B.weight          out x r       (Conv: out x r x 1 x 1)
    base_model.model.<module>.lora_B.bias            out           (``lora_bias``)
    base_model.model.<module>.lora_embedding_A       r x vocab     (Embedding; no ``.weight``)
    base_model.model.<module>.lora_embedding_B       dim x r
    base_model.model.<module>.lora_magnitude_vector  out           (DoRA; no ``.weight``)
    base_model.model.<module>.weight / .bias         full tensors  (``modules_to_save``, biases,
                                                                    saved embedding layers)

``<module>`` is the module's name in the base model (``model.layers.0.self_attn.q_proj``): the
name ``target_modules``, ``rank_pattern`` and ``alpha_pattern`` are matched against, and, with
``.weight`` appended, the base checkpoint's tensor name. The update PEFT adds to the base weight
is ``scaling·B·A`` (Linear, in ``out x in`` layout), its transpose for ``fan_in_fan_out``
(Conv1D) layers and for embeddings (whose base weight is ``vocab x dim``), with
``scaling = lora_alpha / r``, or ``lora_alpha / √r`` under ``use_rslora`` (r and alpha per module
after ``rank_pattern``/``alpha_pattern``).

Everything here except :func:`open_adapter` is pure: names, shapes and JSON in, plain data out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from dghard_cli.errors import InputError
from dghard_cli.io.checkpoint import Checkpoint, TensorInfo, _safe_member, allowed_root, read_json_file
from dghard_cli.io.hub import resolve_dir
from dghard_cli.lora.config import ADAPTER_CONFIG, MAX_CONFIG_BYTES, PICKLE_HINT, LoraConfig
from dghard_cli.lora.targets import list_matches

ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


# -- tensor names -----------------------------------------------------------------------------------
_SUFFIXES = (
    (".lora_A.weight", "a"),
    (".lora_B.weight", "b"),
    (".lora_B.bias", "b_bias"),
    (".lora_embedding_A", "a"),
    (".lora_embedding_B", "b"),
    (".lora_magnitude_vector", "magnitude"),
)
_NAMED = re.compile(
    r"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)"
    r"\.(?P<adapter>[A-Za-z0-9_\-]+)(?P<rest>\.weight|\.bias)?$"
)
_PART_KIND = {
    ("lora_A", ".weight"): "a",
    ("lora_B", ".weight"): "b",
    ("lora_B", ".bias"): "b_bias",
    ("lora_embedding_A", ""): "a",
    ("lora_embedding_B", ""): "b",
    ("lora_magnitude_vector", ""): "magnitude",
    ("lora_magnitude_vector", ".weight"): "magnitude",
}


@dataclass
class LoraModule:
    """The tensors of one adapted module."""

    module: str  # module name in the base model, e.g. model.layers.0.self_attn.q_proj
    embedding: bool = False
    a: TensorInfo | None = None
    b: TensorInfo | None = None
    b_bias: TensorInfo | None = None
    magnitude: TensorInfo | None = None

    @property
    def tensors(self) -> list[TensorInfo]:
        return [t for t in (self.a, self.b, self.b_bias, self.magnitude) if t is not None]


@dataclass
class AdapterLayout:
    """An adapter's tensors sorted by what PEFT does with them."""

    modules: dict[str, LoraModule] = field(default_factory=dict)
    full: list[tuple[TensorInfo, str]] = field(default_factory=list)  # (tensor, base tensor name)
    tokens: list[TensorInfo] = field(default_factory=list)  # trainable-token deltas
    unprefixed: list[str] = field(default_factory=list)
    adapter_named: list[str] = field(default_factory=list)
    unrecognized: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)


def strip_prefix(name: str) -> tuple[str, bool]:
    if name.startswith(PEFT_PREFIX):
        return name[len(PEFT_PREFIX) :], True
    return name, False


def classify_tensors(tensors: list[TensorInfo]) -> AdapterLayout:
    """Group tensors by module and role (A, B, bias, magnitude; full tensors; leftovers)."""
    lay = AdapterLayout()
    for t in tensors:
        rel, prefixed = strip_prefix(t.name)
        kind = module = None
        embedding = False
        for suffix, k in _SUFFIXES:
            if rel.endswith(suffix):
                kind, module = k, rel[: -len(suffix)]
                embedding = "lora_embedding_" in suffix
                break
        if kind is None:
            m = _NAMED.match(rel)
            if m and (m["part"], m["rest"] or "") in _PART_KIND:
                kind, module = _PART_KIND[(m["part"], m["rest"] or "")], m["module"]
                embedding = m["part"].startswith("lora_embedding_")
                lay.adapter_named.append(t.name)
        if kind is None:
            if rel.endswith(".trainable_tokens_delta"):
                lay.tokens.append(t)
            elif any(part.startswith("lora_") for part in rel.split(".")):
                lay.unrecognized.append(t.name)
            else:
                lay.full.append((t, rel.replace(".base_layer.", ".")))
            if not prefixed:
                lay.unprefixed.append(t.name)
            continue
        if not prefixed:
            lay.unprefixed.append(t.name)
        mod = lay.modules.setdefault(module, LoraModule(module))
        mod.embedding = mod.embedding or embedding
        if getattr(mod, kind) is not None:
            lay.duplicates.append(t.name)
            continue
        setattr(mod, kind, t)
    return lay


def module_to_save(cfg: LoraConfig, base_name: str) -> bool:
    """Is a full tensor (``<module>.weight``) a ``modules_to_save`` copy?"""
    module = base_name.rsplit(".", 1)[0]
    return list_matches(cfg.modules_to_save, module)


# -- files --------------------------------------------------------------------------------------------
class AdapterWeights(Checkpoint):
    """``adapter_model.safetensors`` as a validated checkpoint (only that file is read)."""

    def __init__(self, file: Path, *, source: str, revision: str | None) -> None:
        self._file = Path(file)
        super().__init__(self._file.parent, label="adapter", source=source, revision=revision)

    def _discover(self) -> None:
        d = self.path
        name = self._file.name
        self.shards = [name]
        self._load_shard(_safe_member(d, name, allowed_root(d), str(d)), name)
        self.tensors = dict(sorted(self.tensors.items(), key=lambda kv: kv[1].offset))


@dataclass
class Adapter:
    source: str
    path: Path
    revision: str | None
    config_raw: dict
    weights: AdapterWeights

    def describe(self) -> dict:
        return {
            "source": self.source,
            "path": str(self.path),
            "revision": self.revision,
            "tensors": len(self.weights.tensors),
            "bytes": self.weights.total_bytes,
            "dtypes": sorted({t.dtype for t in self.weights.tensors.values()}),
        }


def open_adapter(spec: str, *, revision: str | None = None) -> Adapter:
    """Find and validate a PEFT adapter (directory, one of its files, or a Hub id)."""
    local = Path(spec).expanduser()
    if local.is_file() and (local.name == ADAPTER_CONFIG or local.suffix in (".safetensors", ".bin")):
        spec_dir = str(local.parent)
    else:
        spec_dir = spec
    path = resolve_dir(spec_dir, revision=revision, label="adapter")
    if not path.is_dir():
        raise InputError(f"adapter {spec}: not a directory; pass the adapter directory")
    config_path = path / ADAPTER_CONFIG
    weights_path = path / ADAPTER_WEIGHTS
    if not config_path.exists():
        subdirs = sorted(p.name for p in path.iterdir() if p.is_dir() and (p / ADAPTER_CONFIG).exists())
        if subdirs:
            raise InputError(
                f"adapter {path}: no {ADAPTER_CONFIG} here, but adapters in subdirectories "
                f"({', '.join(subdirs[:5])}); pass one of them"
            )
        if (path / "config.json").exists() and not weights_path.exists():
            raise InputError(
                f"adapter {path}: no {ADAPTER_CONFIG}; this looks like a full model checkpoint, "
                "not a PEFT adapter (use `dghard inspect` or `repair` for full fine-tunes)"
            )
        raise InputError(f"adapter {path}: no {ADAPTER_CONFIG}; PEFT cannot load an adapter without it")
    if not weights_path.exists():
        pickles = [
            n for n in ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth") if (path / n).exists()
        ]
        if pickles:
            raise InputError(
                f"adapter {path}: only pickle weights ({pickles[0]}), which dghard never unpickles",
                hint=PICKLE_HINT,
            )
        raise InputError(
            f"adapter {path}: no {ADAPTER_WEIGHTS} (a Hub repository may hold only a pickle "
            "adapter_model.bin, which is never downloaded)"
        )
    raw = read_json_file(config_path, ADAPTER_CONFIG, limit=MAX_CONFIG_BYTES, roots=allowed_root(path))
    if not isinstance(raw, dict):
        raise InputError(f"{config_path}: adapter_config.json is not a JSON object")
    weights = AdapterWeights(weights_path, source=spec, revision=revision)
    return Adapter(source=spec, path=path, revision=revision, config_raw=raw, weights=weights)
