"""Audit findings: one finding = a level, a stable code, the module it concerns, a sentence.

Every code has exactly one level, fixed here, so a CI rule written against a code keeps its
meaning across releases. :data:`CODES` is the single source of truth for the table of codes in
the README (``tests`` check that the two agree).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

LEVELS = ("info", "warn", "error")
LEVEL_RANK = {name: i for i, name in enumerate(LEVELS)}

#: code -> (level, what it means). Ordered as the README table.
CODES: dict[str, tuple[str, str]] = {
    # -- errors: the adapter does not do what was trained, or cannot be loaded ------------------
    "CONFIG_INVALID": (
        "error",
        "a config value has the wrong type or range, or a pattern is not a valid regex",
    ),
    "ADAPTER_EMPTY": ("error", "the weights file holds no LoRA tensors"),
    "KEY_PREFIX_MISSING": ("error", "LoRA tensor names lack the `base_model.model.` prefix PEFT loads by"),
    "KEY_ADAPTER_NAME": ("error", "tensor names still carry an adapter name (`lora_A.default.weight`)"),
    "NON_FLOAT_TENSOR": ("error", "a LoRA tensor is stored in an integer or boolean dtype"),
    "A_MISSING": ("error", "a module has `lora_B` but no `lora_A`"),
    "B_MISSING": ("error", "a module has `lora_A` but no `lora_B`"),
    "AB_SHAPE_MISMATCH": ("error", "the inner dimensions of A and B disagree, or a factor is not a matrix"),
    "RANK_MISMATCH": ("error", "the stored rank differs from the configured `r` (after `rank_pattern`)"),
    "EMBEDDING_ORIENTATION": (
        "error",
        "embedding factors stored transposed (`lora_embedding_A` must be r x vocab, `lora_embedding_B` dim x r)",
    ),
    "MODULE_NOT_TARGETED": (
        "error",
        "weights for a module the config does not target: PEFT creates no layer there and drops them",
    ),
    "DORA_MAGNITUDE_MISSING": ("error", "`use_dora` is true but a module has no `lora_magnitude_vector`"),
    "DORA_MAGNITUDE_UNEXPECTED": ("error", "`lora_magnitude_vector` present but `use_dora` is false"),
    "DORA_MAGNITUDE_SHAPE": ("error", "a DoRA magnitude vector's length is not the module's output size"),
    "LORA_BIAS_UNEXPECTED": ("error", "`lora_B.bias` present but `lora_bias` is false: PEFT drops it"),
    "LORA_BIAS_SHAPE": ("error", "a `lora_B.bias` length is not the module's output size"),
    "NONFINITE": ("error", "NaN or Inf values in a tensor"),
    "A_ALL_ZERO": ("error", "every entry of A is zero: the module's update is zero"),
    "B_ALL_ZERO": ("error", "every entry of B is zero: the module never trained (PEFT initialises B to 0)"),
    "ADAPTER_NOOP": ("error", "every module's update is zero: the adapter changes nothing"),
    "BASE_MODULE_MISSING": ("error", "the base has no weight for an adapted module (`--base`)"),
    "BASE_SHAPE_MISMATCH": ("error", "a module's update does not fit the base weight's shape (`--base`)"),
    # -- warnings: probably not what the author meant ---------------------------------------------
    "CONFIG_KEY_TYPO": (
        "warn",
        "an unknown config key, set, within two edits of a known one (PEFT ignores it)",
    ),
    "PATTERN_UNMATCHED": ("warn", "a `rank_pattern`/`alpha_pattern` key matches no adapted module"),
    "TARGET_UNMATCHED": ("warn", "a `target_modules` entry matches no module with weights in the file"),
    "MODULE_WEIGHTS_MISSING": (
        "warn",
        "base modules the config targets have no adapter weights: PEFT adds untrained layers (`--base`)",
    ),
    "MODULES_TO_SAVE_MISSING": ("warn", "a `modules_to_save` entry has no saved weights"),
    "LORA_BIAS_MISSING": ("warn", "`lora_bias` is true but a module has no `lora_B.bias`"),
    "DORA_MAGNITUDE_NONPOSITIVE": ("warn", "a DoRA magnitude vector has zero or negative entries"),
    "DELTA_TINY": (
        "warn",
        "the update ‖scaling·B·A‖_F is tiny next to the base weight (`--base`) or the adapter's other modules",
    ),
    "UNRECOGNIZED_TENSOR": ("warn", "a tensor PEFT's LoRA loader does not recognise (it is ignored)"),
    "FAN_IN_FAN_OUT_MISMATCH": (
        "warn",
        "the update fits the base only transposed: `fan_in_fan_out` disagrees with the base layout (`--base`)",
    ),
    "BASE_NAME_MISMATCH": ("warn", "the declared `base_model_name_or_path` is not the base given (`--base`)"),
    "BASE_REVISION_MISMATCH": ("warn", "the declared `revision` is not the `--base-revision` given"),
    # -- information ------------------------------------------------------------------------------
    "CONFIG_UNKNOWN_KEY": (
        "info",
        "a config key known neither to this audit nor to the installed PEFT (newer PEFT, or a custom key)",
    ),
    "CONFIG_KEY_UNCHECKED": (
        "info",
        "a config key the installed PEFT knows but this audit does not check, set to a value",
    ),
    "RSLORA_SCALING": ("info", "`use_rslora`: updates are scaled by α/√r, not α/r"),
    "BASE_UNDECLARED": ("info", "the config does not name its base model"),
    "BASE_REVISION_UNVERIFIED": ("info", "the config pins a base revision that this run cannot compare"),
    "RANK_DEFICIENT": ("info", "B·A has fewer resolvable directions than its rank r"),
    "INTRUDER_DIMENSIONS": (
        "info",
        "top singular vectors of W_base + ΔW unlike any base singular vector (`--base`)",
    ),
}


def level_of(code: str) -> str:
    return CODES[code][0]


@dataclass(frozen=True)
class Finding:
    """One audit finding; ``details`` holds the numbers behind the message (JSON-safe)."""

    level: str
    code: str
    module: str | None
    message: str
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "level": self.level,
            "code": self.code,
            "module": self.module,
            "message": self.message,
            "details": self.details,
        }


def finding(code: str, module: str | None, message: str, **details: object) -> Finding:
    """A finding whose level is the code's fixed level."""
    return Finding(level_of(code), code, module, message, dict(details))


def reaches(level: str, threshold: str) -> bool:
    """True when ``level`` is at or above ``threshold`` (info < warn < error)."""
    return LEVEL_RANK[level] >= LEVEL_RANK[threshold]


def natural_key(text: str | None) -> tuple:
    """Sort key that orders ``layers.2`` before ``layers.10``."""
    if text is None:
        return ((0, ""),)
    return tuple((1, int(p)) if p.isdigit() else (2, p) for p in re.split(r"(\d+)", text) if p)


def sort_findings(items: list[Finding]) -> list[Finding]:
    """Errors first, then warnings, then info; by code, then module in natural order."""
    return sorted(items, key=lambda f: (-LEVEL_RANK[f.level], f.code, natural_key(f.module)))


#: Examples listed in an aggregated finding's message.
EXAMPLES = 3
