"""Which keys of an ``adapter_config.json`` PEFT knows, and what the audit says of the others.

Three sources, so that a PEFT release newer than this dghard does not turn every adapter it
saves into a finding (PEFT 0.22 writes ``"astra_config": null`` into every adapter, and the
audit called it a typo of ``kasa_config``):

- :data:`KNOWN_KEYS`: every field of ``peft.LoraConfig`` in the releases this dghard was tested
  with (the pinned release; ``tests/test_lora_peft.py`` checks it against the installed PEFT),
  plus keys earlier releases wrote;
- :func:`installed_peft_fields`: the fields of the PEFT installed next to dghard, read from its
  source without importing it (importing PEFT imports transformers: seconds);
- a key in neither is a custom key or one of a release newer than both: an info finding, never
  a warning on its own.

A typo (a warning) is a key in none of these, *set* to a value (PEFT writes the fields it does
not use as ``null``, ``false`` or empty), one typo away from a known key: one word of it changed
by an edit or two (:func:`_words_apart`).
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from dghard_cli.lora.findings import Finding, finding

#: Every field of ``peft.LoraConfig`` (with ``PeftConfig``'s) in PEFT 0.22.0, the release CI
#: pins, plus keys earlier releases wrote (``merge_weights``, ``enable_lora``: PEFT 0.2).
KNOWN_KEYS = frozenset(
    {
        "kasa_config",
        "astra_config",
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

#: The classes whose fields make up a LoRA config, and the module (under ``peft/``) of each.
_PEFT_CLASSES = (
    ("tuners/lora/config.py", "LoraConfig"),
    ("config.py", "PeftConfig"),
    ("config.py", "PeftConfigMixin"),
)

#: Largest number of edits between a key and a known key for the key to be called its typo.
TYPO_EDITS = 2


@dataclass(frozen=True)
class InstalledPeft:
    """The PEFT release installed next to dghard: its version and ``LoraConfig``'s fields."""

    version: str
    fields: frozenset[str]


def _class_fields(source: str, name: str) -> set[str] | None:
    """The annotated class-level names of class ``name`` in ``source`` (a dataclass's fields)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return {
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            }
    return None


def _fields_from_source(root: Path) -> frozenset[str] | None:
    found: set[str] = set()
    for rel, cls in _PEFT_CLASSES:
        try:
            names = _class_fields((root / rel).read_text(encoding="utf-8"), cls)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            return None
        if names is None:
            return None
        found |= names
    return frozenset(found) if "r" in found and "lora_alpha" in found else None


@cache
def installed_peft_fields() -> InstalledPeft | None:
    """The installed PEFT's ``LoraConfig`` fields, or None where PEFT is not installed or its
    fields cannot be read. An already imported PEFT is asked directly; otherwise its source is
    parsed (the test suite checks that both agree on the installed release)."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            ver = version("peft")
        except PackageNotFoundError:
            return None
        peft = sys.modules.get("peft")
        if peft is not None and hasattr(peft, "LoraConfig"):
            import dataclasses

            return InstalledPeft(ver, frozenset(f.name for f in dataclasses.fields(peft.LoraConfig)))
        spec = importlib.util.find_spec("peft")
    except (ImportError, ValueError, TypeError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        return None
    fields = _fields_from_source(Path(locations[0]))
    return InstalledPeft(ver, fields) if fields else None


def edits(a: str, b: str) -> int:
    """Damerau–Levenshtein distance (optimal string alignment): insertions, deletions,
    substitutions and transpositions of neighbours, one edit each."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        cur = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = 0 if a[i - 1] == b[j - 1] else 1
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[-1]


def _is_set(value: object) -> bool:
    """Whether a value says something: PEFT writes the fields a config does not use as null,
    false or empty."""
    return value not in (None, False, "") and value != [] and value != {}


def _words_apart(key: str, known: str) -> int | None:
    """Edits between ``key`` and ``known`` when they are one typo apart, else None.

    Compared word by word (``_``-separated): exactly one word differs, by at most one edit in
    a word of up to four letters and :data:`TYPO_EDITS` in a longer one (``lora_aplha``,
    ``target_module``); keys whose words do not pair up differ by one edit at most
    (``use_rs_lora``). Whole-key distance alone called ``astra_config`` a typo of
    ``kasa_config``: a new method's sub-config differs in the one word that names it."""
    a, b = key.split("_"), known.split("_")
    if len(a) != len(b):
        d = edits(key, known)
        return d if d <= 1 else None
    differing = [(x, y) for x, y in zip(a, b, strict=True) if x != y]
    if len(differing) != 1:
        return None
    x, y = differing[0]
    d = edits(x, y)
    return d if d <= (1 if min(len(x), len(y)) <= 4 else TYPO_EDITS) else None


#: Longest key checked for a typo (PEFT's longest is 24 characters): a 1 MB key cost minutes.
MAX_TYPO_KEY = 64


def _near_miss(key: str, known: frozenset[str]) -> str | None:
    """The known key one typo away from ``key`` (the closest; None if none)."""
    if not 3 <= len(key) <= MAX_TYPO_KEY:
        return None
    near = (k for k in known if abs(len(k) - len(key)) <= TYPO_EDITS)  # more edits than that: no typo
    found = [(d, k) for k in near if (d := _words_apart(key, k)) is not None]
    return min(found)[1] if found else None


def key_findings(raw: dict, installed: InstalledPeft | None = None) -> list[Finding]:
    """Findings for the keys of ``raw`` that :data:`KNOWN_KEYS` does not list: none for a field
    of the installed PEFT left at its default, info for one that is set (its meaning is not
    checked here) and for a key unknown to both, a warning for a set near-miss of a known key."""
    if installed is None:
        installed = installed_peft_fields()
    peft_fields = installed.fields if installed is not None else frozenset()
    release = (
        f"the installed PEFT {installed.version}" if installed is not None else "PEFT (not installed here)"
    )
    out: list[Finding] = []
    for key in raw:
        if not isinstance(key, str) or key in KNOWN_KEYS:
            continue
        value = raw[key]
        if key in peft_fields:
            if _is_set(value):
                out.append(
                    finding(
                        "CONFIG_KEY_UNCHECKED",
                        None,
                        f"config key {key!r} is a setting of {release} that this audit "
                        "does not check; if it changes the update, the adapter is "
                        "not the plain scaling·B·A that dghard reads.",
                        key=key,
                    )
                )
            continue
        close = _near_miss(key, KNOWN_KEYS | peft_fields) if _is_set(value) else None
        if close is not None:
            out.append(
                finding(
                    "CONFIG_KEY_TYPO",
                    None,
                    f"config key {key!r} is set but unknown, and PEFT ignores it; did you mean {close!r}?",
                    key=key,
                    suggestion=close,
                )
            )
            continue
        out.append(
            finding(
                "CONFIG_UNKNOWN_KEY",
                None,
                f"config key {key!r} is known neither to this audit nor to {release}: a custom key "
                "or one of a newer PEFT release; PEFT releases that do not know it ignore it.",
                key=key,
            )
        )
    return out
