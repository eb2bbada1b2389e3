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

import difflib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from dghard_cli.audit.findings import Finding, finding
from dghard_cli.errors import InputError
from dghard_cli.io.checkpoint import Checkpoint, TensorInfo, _safe_member, allowed_root, read_json_file
from dghard_cli.io.hub import resolve_dir

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
#: Largest rank accepted in a config (larger is refused as absurd: no layer is that wide).
MAX_RANK = 65536
MAX_CONFIG_BYTES = 4 * 1024 * 1024

PICKLE_HINT = (
    'convert it to safetensors first, e.g. `python -c "import torch; from safetensors.torch import '
    "save_file; sd = torch.load('DIR/adapter_model.bin', weights_only=True); "
    "save_file({k: v.contiguous() for k, v in sd.items()}, 'DIR/adapter_model.safetensors')\"` "
    "(weights_only=True refuses code; PeftModel.save_pretrained(DIR, safe_serialization=True) also works)"
)

#: Keys of PEFT's LoraConfig and PeftConfig across releases (unknown keys are reported, not refused):
#: every field of ``peft.LoraConfig`` in PEFT 0.21.2 (tests/test_lora_peft.py checks the installed
#: PEFT against this list), plus keys earlier releases wrote (``merge_weights``, ``enable_lora``:
#: PEFT 0.2).
KNOWN_KEYS = frozenset(
    {
        "kasa_config",
        "merge_weights",
        "enable_lora",
        "peft_type",
        "task_type",
        "inference_mode",
        "base_model_name_or_path",
        "revision",
        "auto_mapping",
        "peft_version",
        "r",
        "target_modules",
        "exclude_modules",
        "lora_alpha",
        "lora_dropout",
        "fan_in_fan_out",
        "bias",
        "use_rslora",
        "modules_to_save",
        "init_lora_weights",
        "layers_to_transform",
        "layers_pattern",
        "rank_pattern",
        "alpha_pattern",
        "megatron_config",
        "megatron_core",
        "trainable_token_indices",
        "loftq_config",
        "eva_config",
        "corda_config",
        "lora_ga_config",
        "monteclora_config",
        "velora_config",
        "arrow_config",
        "use_dora",
        "use_qalora",
        "qalora_group_size",
        "use_bdlora",
        "layer_replication",
        "runtime_config",
        "lora_bias",
        "target_parameters",
        "alora_invocation_tokens",
        "ensure_weight_tying",
    }
)

#: Leaf names of output layers, which ``target_modules="all-linear"`` leaves out.
OUTPUT_LAYER_NAMES = ("lm_head", "embed_out", "output_layer")


# -- config ---------------------------------------------------------------------------------------
@dataclass
class LoraConfig:
    """The parts of ``adapter_config.json`` that decide what the weights mean."""

    r: int = 8
    lora_alpha: float | None = 8.0  # None when the value is invalid (then scaling is unknown)
    use_rslora: bool = False
    use_dora: bool = False
    fan_in_fan_out: bool = False
    lora_bias: bool = False
    bias: str = "none"
    target_modules: str | list[str] | None = None
    exclude_modules: str | list[str] | None = None
    layers_to_transform: list[int] | None = None
    layers_pattern: list[str] | None = None
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    modules_to_save: list[str] = field(default_factory=list)
    base_model_name_or_path: str | None = None
    revision: str | None = None
    peft_type: str | None = "LORA"

    def rank_for(self, module: str) -> int:
        key = pattern_key(self.rank_pattern, module)
        return self.rank_pattern[key] if key is not None else self.r

    def alpha_for(self, module: str) -> float | None:
        key = pattern_key(self.alpha_pattern, module)
        return self.alpha_pattern[key] if key is not None else self.lora_alpha

    def scaling_for(self, module: str) -> float | None:
        """PEFT's scaling of ``B·A`` for this module: α/r, or α/√r under ``use_rslora``."""
        alpha = self.alpha_for(module)
        if alpha is None:
            return None
        r = self.rank_for(module)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def summary(self) -> dict:
        return {
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "use_rslora": self.use_rslora,
            "use_dora": self.use_dora,
            "fan_in_fan_out": self.fan_in_fan_out,
            "lora_bias": self.lora_bias,
            "bias": self.bias,
            "target_modules": self.target_modules,
            "exclude_modules": self.exclude_modules,
            "layers_to_transform": self.layers_to_transform,
            "rank_pattern": self.rank_pattern,
            "alpha_pattern": self.alpha_pattern,
            "modules_to_save": self.modules_to_save,
            "base_model_name_or_path": self.base_model_name_or_path,
            "revision": self.revision,
        }


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _check_rank(value: object, what: str, where: str) -> int:
    if not _is_int(value) or not 1 <= value <= MAX_RANK:
        raise InputError(
            f"{where}: {what} = {value!r} is not a LoRA rank (a whole number from 1 to {MAX_RANK}); "
            "fix the config or re-save the adapter with PEFT"
        )
    return value


def _valid_regex(pattern: str) -> str | None:
    try:
        re.compile(pattern)
    except re.error as exc:
        return str(exc)
    return None


def parse_config(raw: object, where: str) -> tuple[LoraConfig, list[Finding]]:
    """Validate ``adapter_config.json``; absurd values raise InputError, the rest are findings."""
    if not isinstance(raw, dict):
        raise InputError(f"{where}: adapter_config.json is not a JSON object")
    cfg = LoraConfig()
    out: list[Finding] = []

    def invalid(key: str, message: str) -> None:
        out.append(finding("CONFIG_INVALID", None, message, key=key, value=_jsonable(raw.get(key))))

    peft_type = raw.get("peft_type")
    if peft_type is None:
        invalid(
            "peft_type",
            'adapter_config.json has no peft_type; PEFT cannot load it — add "peft_type": "LORA".',
        )
    elif not isinstance(peft_type, str):
        invalid("peft_type", f'peft_type {peft_type!r} is not a string; set it to "LORA".')
    elif peft_type.upper() != "LORA":
        raise InputError(
            f'{where}: peft_type is {peft_type!r}; audit-lora audits LoRA and DoRA adapters (peft_type "LORA")'
        )

    if "r" in raw and raw["r"] is not None:
        cfg.r = _check_rank(raw["r"], "r", where)

    alpha = raw.get("lora_alpha", 8)
    if not _is_number(alpha):
        cfg.lora_alpha = None
        invalid(
            "lora_alpha",
            f"lora_alpha {alpha!r} is not a finite number, so PEFT's scaling α/r is undefined; set it "
            "to the value used in training (norms below are computed with scaling 1).",
        )
    elif alpha == 0:
        cfg.lora_alpha = 0.0
        invalid("lora_alpha", "lora_alpha is 0, so every update is multiplied by 0; set the trained value.")
    else:
        cfg.lora_alpha = float(alpha)

    for key in ("use_rslora", "use_dora", "fan_in_fan_out", "lora_bias", "inference_mode"):
        v = raw.get(key)
        if v is None:
            continue
        if not isinstance(v, bool):
            invalid(
                key, f"{key} is {v!r}; it must be true or false (PEFT reads any non-empty value as true)."
            )
            v = bool(v)
        if hasattr(cfg, key):
            setattr(cfg, key, v)

    bias = raw.get("bias", "none")
    if bias is None:
        bias = "none"
    if bias not in ("none", "all", "lora_only"):
        invalid("bias", f'bias is {bias!r}; PEFT accepts "none", "all" or "lora_only".')
    else:
        cfg.bias = bias

    dropout = raw.get("lora_dropout", 0.0)
    if dropout is not None and (not _is_number(dropout) or not 0 <= dropout < 1):
        invalid("lora_dropout", f"lora_dropout is {dropout!r}; it must be a number in [0, 1).")

    for key in ("target_modules", "exclude_modules"):
        v = raw.get(key)
        if v is None:
            continue
        if isinstance(v, str):
            err = _valid_regex(v)
            if err:
                invalid(key, f"{key} {v!r} is not a valid regular expression ({err}); PEFT fails to load it.")
                continue
            setattr(cfg, key, v)
        elif isinstance(v, list) and all(isinstance(t, str) for t in v):
            setattr(cfg, key, list(v))
        else:
            invalid(key, f"{key} must be a list of module names or one regular expression, not {v!r}.")

    ltt = raw.get("layers_to_transform")
    if ltt is not None:
        if _is_int(ltt):
            cfg.layers_to_transform = [ltt]
        elif isinstance(ltt, list) and all(_is_int(i) for i in ltt):
            cfg.layers_to_transform = list(ltt) or None
        else:
            invalid(
                "layers_to_transform",
                f"layers_to_transform must be a layer index or a list of them, not {ltt!r}.",
            )
        if cfg.layers_to_transform is not None and isinstance(cfg.target_modules, str):
            invalid(
                "layers_to_transform",
                "layers_to_transform cannot be combined with a regex target_modules; PEFT refuses this config.",
            )
    lp = raw.get("layers_pattern")
    if lp is not None:
        if isinstance(lp, str):
            cfg.layers_pattern = [lp]
        elif isinstance(lp, list) and all(isinstance(p, str) for p in lp):
            cfg.layers_pattern = list(lp) or None
        else:
            invalid("layers_pattern", f"layers_pattern must be a name or a list of names, not {lp!r}.")

    for key, is_rank in (("rank_pattern", True), ("alpha_pattern", False)):
        v = raw.get(key)
        if v is None or v == {}:
            continue
        if not isinstance(v, dict):
            invalid(key, f"{key} must map module-name patterns to values, not {v!r}.")
            continue
        table: dict = {}
        for pat, val in v.items():
            err = _valid_regex(pat)
            if err:
                invalid(
                    key, f"{key} key {pat!r} is not a valid regular expression ({err}); PEFT fails on it."
                )
                continue
            if is_rank:
                table[pat] = _check_rank(val, f"rank_pattern[{pat!r}]", where)
            elif not _is_number(val):
                invalid(key, f"alpha_pattern[{pat!r}] = {val!r} is not a finite number.")
            else:
                table[pat] = float(val)
        setattr(cfg, key, table)

    mts = raw.get("modules_to_save")
    if mts is not None:
        if isinstance(mts, list) and all(isinstance(m, str) for m in mts):
            cfg.modules_to_save = list(mts)
        else:
            invalid("modules_to_save", f"modules_to_save must be a list of module names, not {mts!r}.")

    for key in ("base_model_name_or_path", "revision"):
        v = raw.get(key)
        if v is None or v == "":
            continue
        if isinstance(v, str):
            setattr(cfg, key, v)
        else:
            invalid(key, f"{key} must be a string, not {v!r}.")

    known = sorted(KNOWN_KEYS)
    for key in raw:
        if key in KNOWN_KEYS:
            continue
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.85)
        if close:
            out.append(
                finding(
                    "CONFIG_KEY_TYPO",
                    None,
                    f"config key {key!r} is unknown and PEFT ignores it; did you mean {close[0]!r}?",
                    key=key,
                    suggestion=close[0],
                )
            )
        else:
            out.append(
                finding(
                    "CONFIG_UNKNOWN_KEY",
                    None,
                    f"config key {key!r} is not a LoRA setting known to this audit; PEFT releases "
                    "that do not know it either ignore it or refuse the config.",
                    key=key,
                )
            )
    return cfg, out


def _jsonable(v: object) -> object:
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, (list, dict)):
        return v
    return repr(v)


# -- PEFT's name matching ---------------------------------------------------------------------------
def pattern_key(patterns: dict, module: str) -> str | None:
    """The first ``rank_pattern``/``alpha_pattern`` key that matches ``module``, as PEFT does.

    A key matches when it matches a dot-separated suffix of the module name as a regex:
    ``re.match(rf"(.*\\.)?({key})$", module)``; the first key in file order wins.
    """
    for key in patterns:
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return key
        except re.error:
            continue
    return None


def _list_matches(entries: list[str], module: str) -> bool:
    return module in entries or any(module.endswith("." + e) for e in entries)


def layer_index(module: str, layers_pattern: list[str] | None) -> int | None:
    """The layer number in a module name (``model.layers.7.mlp`` -> 7), found as PEFT finds it:
    the last ``.<name>.<digits>.`` (``<name>`` from ``layers_pattern`` when given)."""
    if layers_pattern:
        for p in layers_pattern:
            m = re.match(rf".*\.{p}\.(\d+)\.", module)
            if m:
                return int(m.group(1))
        return None
    m = re.match(r".*\.[^.]*\.(\d+)\.", module)
    return int(m.group(1)) if m else None


def matches_entry(target: str | list[str], module: str) -> bool:
    """Does one ``target_modules``-style value select ``module`` (list: name or suffix; str: fullmatch)?"""
    if isinstance(target, str):
        if target == "all-linear":
            return module.rsplit(".", 1)[-1] not in OUTPUT_LAYER_NAMES
        try:
            return re.fullmatch(target, module) is not None
        except re.error:
            return False
    return _list_matches(target, module)


def is_targeted(cfg: LoraConfig, module: str, *, embedding: bool = False) -> bool | None:
    """Whether PEFT would put a LoRA layer on ``module``; None when the config does not say.

    ``exclude_modules`` wins; a list ``target_modules`` matches a name or a ``.``-suffix and then
    honours ``layers_to_transform`` (a module with no layer number is then not targeted); a string is
    a full regex match; ``"all-linear"`` takes every linear layer but the output layer.
    """
    if cfg.target_modules is None:
        return None
    if cfg.exclude_modules is not None and matches_entry(cfg.exclude_modules, module):
        return False
    t = cfg.target_modules
    if isinstance(t, str):
        if t == "all-linear" and embedding:
            return False
        return matches_entry(t, module)
    if module in t:
        return True
    if not any(module.endswith("." + e) for e in t):
        return False
    if cfg.layers_to_transform:
        idx = layer_index(module, cfg.layers_pattern)
        return idx is not None and idx in cfg.layers_to_transform
    return True


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
    return _list_matches(cfg.modules_to_save, module)


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
    raw = read_json_file(config_path, ADAPTER_CONFIG, limit=MAX_CONFIG_BYTES)
    if not isinstance(raw, dict):
        raise InputError(f"{config_path}: adapter_config.json is not a JSON object")
    weights = AdapterWeights(weights_path, source=spec, revision=revision)
    return Adapter(source=spec, path=path, revision=revision, config_raw=raw, weights=weights)
