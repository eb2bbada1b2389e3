"""A PEFT LoRA adapter's ``adapter_config.json``: read, every key checked (type, range, a
valid regex), with one-line errors naming the file and key."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from dghard_cli.errors import InputError
from dghard_cli.io.patterns import PLAIN_PATTERN, bounded, pattern_problem, reset_budgets
from dghard_cli.lora.config_keys import key_findings
from dghard_cli.lora.findings import Finding, finding

ADAPTER_CONFIG = "adapter_config.json"


#: Largest rank accepted in a config (larger is refused as absurd: no layer is that wide).
MAX_RANK = 65536


MAX_CONFIG_BYTES = 4 * 1024 * 1024


PICKLE_HINT = (
    'convert it to safetensors first, e.g. `python -c "import torch; from safetensors.torch import '
    "save_file; sd = torch.load('DIR/adapter_model.bin', weights_only=True); "
    "save_file({k: v.contiguous() for k, v in sd.items()}, 'DIR/adapter_model.safetensors')\"` "
    "(weights_only=True refuses code; PeftModel.save_pretrained(DIR, safe_serialization=True) also works)"
)


# -- PEFT's rank_pattern / alpha_pattern matching ---------------------------------------------------
class PatternTable:
    r"""PEFT's ``rank_pattern``/``alpha_pattern`` matching, in time linear in the table's size.

    A key ``k`` matches ``module`` when ``re.match(rf"(.*\.)?({k})$", module)`` does, i.e. when
    ``k`` as a regex matches a suffix of ``module`` that starts at its beginning or after a dot;
    the first key in file order wins. Plain keys (word characters and dots, nearly every real
    key) are grouped by length and dot positions: a suffix ``s`` matches a plain key exactly when
    ``s`` with that group's dot positions replaced by ``.`` is the key, so each group costs one
    dictionary look-up per suffix. Other keys are compiled once and run, in order, under the
    pattern time budget. (Before: every key was recompiled and run for every module, 70 s for a
    100,000-key table.)
    """

    def __init__(self, patterns: dict) -> None:
        self.keys = list(patterns)
        self.order = {k: i for i, k in enumerate(self.keys)}
        groups: dict[tuple[int, tuple[int, ...]], dict[str, int]] = {}
        self.regex: list[tuple[int, str, re.Pattern]] = []
        for i, key in enumerate(patterns):
            if not isinstance(key, str):
                continue
            if PLAIN_PATTERN.fullmatch(key):
                mask = tuple(j for j, c in enumerate(key) if c == ".")
                groups.setdefault((len(key), mask), {}).setdefault(key, i)
                continue
            try:
                self.regex.append((i, key, re.compile(rf"(.*\.)?({key})$")))
            except re.error:
                continue
        self.groups: dict[int, list[tuple[tuple[int, ...], dict[str, int]]]] = {}
        for (length, mask), keys in groups.items():
            self.groups.setdefault(length, []).append((mask, keys))

    def _plain(self, module: str) -> list[int]:
        """Positions (file order) of the plain keys that match ``module``."""
        found: list[int] = []
        starts = [0] + [j + 1 for j, c in enumerate(module) if c == "."]
        for s0 in starts:
            s = module[s0:]
            for mask, keys in self.groups.get(len(s), ()):
                if mask:
                    chars = list(s)
                    for j in mask:
                        chars[j] = "."
                    probe = "".join(chars)
                else:
                    probe = s
                pos = keys.get(probe)
                if pos is not None:
                    found.append(pos)
        return found

    def _regex_first(self, module: str, before: int) -> int | None:
        for pos, key, rx in self.regex:
            if pos >= before:
                return None
            with bounded(f"rank_pattern/alpha_pattern key {key!r}", key):
                if rx.match(module) is not None:
                    return pos
        return None

    def first(self, module: str) -> int | None:
        """The file position of the first key that matches ``module`` (None: none does)."""
        plain = self._plain(module)
        best = min(plain) if plain else len(self.order)
        pos = self._regex_first(module, best)
        return pos if pos is not None else (best if plain else None)

    def matched(self, modules) -> set[int]:
        """Positions of every key that matches at least one of ``modules``."""
        hit: set[int] = set()
        for m in modules:
            hit.update(self._plain(m))
        for pos, key, rx in self.regex:
            with bounded(f"rank_pattern/alpha_pattern key {key!r}", key):
                if any(rx.match(m) is not None for m in modules):
                    hit.add(pos)
        return hit


_TABLES: dict[int, tuple[dict, int, PatternTable]] = {}


def pattern_table(patterns: dict) -> PatternTable:
    """The (cached) :class:`PatternTable` of a pattern dict."""
    got = _TABLES.get(id(patterns))
    if got is not None and got[0] is patterns and got[1] == len(patterns):
        return got[2]
    if len(_TABLES) > 64:
        _TABLES.clear()
    table = PatternTable(patterns)
    _TABLES[id(patterns)] = (patterns, len(patterns), table)
    return table


def pattern_key(patterns: dict, module: str) -> str | None:
    r"""The first ``rank_pattern``/``alpha_pattern`` key that matches ``module``, as PEFT does.

    A key matches when it matches a dot-separated suffix of the module name as a regex:
    ``re.match(rf"(.*\.)?({key})$", module)``; the first key in file order wins.
    """
    if not patterns:
        return None
    table = pattern_table(patterns)
    pos = table.first(module)
    return None if pos is None else table.keys[pos]


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
    """Why a config's regex cannot be used (None: it can): invalid, or able to hang the matcher
    (:func:`dghard_cli.io.patterns.pattern_problem`)."""
    return pattern_problem(pattern)


def parse_config(raw: object, where: str) -> tuple[LoraConfig, list[Finding]]:
    """Validate ``adapter_config.json``; absurd values raise InputError, the rest are findings."""
    if not isinstance(raw, dict):
        raise InputError(f"{where}: adapter_config.json is not a JSON object")
    reset_budgets()
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
                invalid(key, f"{key} {v!r} cannot be matched: {err}; PEFT fails (or hangs) on it.")
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
        bad = [(p, _valid_regex(p)) for p in cfg.layers_pattern or []]
        bad = [(p, e) for p, e in bad if e]
        if bad:
            invalid("layers_pattern", f"layers_pattern {bad[0][0]!r} cannot be matched: {bad[0][1]}.")
            cfg.layers_pattern = None

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
                invalid(key, f"{key} key {pat!r} cannot be matched: {err}; PEFT fails (or hangs) on it.")
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

    out += key_findings(raw)
    return cfg, out


def _jsonable(v: object) -> object:
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, (list, dict)):
        return v
    return repr(v)
