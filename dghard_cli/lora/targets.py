"""Which modules a LoRA config targets, with PEFT's own matching rules: ``target_modules``
(suffix list, a full regex or ``all-linear``), ``exclude_modules`` and
``layers_to_transform``/``layers_pattern``. (The ``rank_pattern``/``alpha_pattern`` keys are
matched in :mod:`dghard_cli.lora.config`, which owns those keys.)"""

from __future__ import annotations

import re

from dghard_cli.architecture import OUTPUT_LAYER_NAMES
from dghard_cli.io.patterns import bounded, peft_fullmatch
from dghard_cli.lora.config import LoraConfig


# -- PEFT's name matching ---------------------------------------------------------------------------
def list_matches(entries: list[str], module: str) -> bool:
    return module in entries or any(module.endswith("." + e) for e in entries)


def layer_index(module: str, layers_pattern: list[str] | None) -> int | None:
    """The layer number in a module name (``model.layers.7.mlp`` -> 7), found as PEFT finds it:
    the last ``.<name>.<digits>.`` (``<name>`` from ``layers_pattern`` when given)."""
    if layers_pattern:
        for p in layers_pattern:
            with bounded(f"layers_pattern {p!r}", p):
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
            with bounded(f"regex {target!r}", target):
                return peft_fullmatch(target, module)
        except re.error:
            return False
    return list_matches(target, module)


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
