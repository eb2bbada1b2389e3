"""Checks of an adapter's config against its tensors: each module's geometry (shapes, rank,
rank/alpha patterns), extra or misnamed tensors, which modules the config targets, and full
tensors PEFT would not expect. Nothing here reads tensor values."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dghard_cli.architecture import EMBEDDING_OR_HEAD_PARTS
from dghard_cli.lora.adapter import PEFT_PREFIX, AdapterLayout, LoraModule, module_to_save
from dghard_cli.lora.config import LoraConfig, pattern_key, pattern_table
from dghard_cli.lora.findings import (
    EXAMPLES,
    Finding,
    finding,
)
from dghard_cli.lora.targets import is_targeted


# -- geometry of a module -------------------------------------------------------------------------
@dataclass
class Geometry:
    """What a module's factors say about its layer: ``out x in`` in PEFT's orientation."""

    kind: str  # linear | conv | embedding
    rank: int
    out: int
    inp: int
    a_shape: tuple[int, ...]
    transposed_factors: bool = False  # embedding factors stored the other way round


def module_geometry(mod: LoraModule, cfg: LoraConfig) -> tuple[Geometry | None, list[Finding]]:
    """Check A/B presence and shapes of one module; its geometry when they are consistent."""
    name = mod.module
    out: list[Finding] = []
    if mod.a is None and mod.b is None:
        return None, out
    a_name = "lora_embedding_A" if mod.embedding else "lora_A"
    b_name = "lora_embedding_B" if mod.embedding else "lora_B"
    if mod.a is None:
        out.append(
            finding(
                "A_MISSING",
                name,
                f"{b_name} has no matching {a_name}; PEFT leaves A at its random initialisation, "
                "so this module adds noise — re-export the adapter from the training run.",
                tensor=mod.b.name,
            )
        )
        return None, out
    if mod.b is None:
        out.append(
            finding(
                "B_MISSING",
                name,
                f"{a_name} has no matching {b_name}; PEFT initialises B to zero, so this module does "
                "nothing — re-export the adapter from the training run.",
                tensor=mod.a.name,
            )
        )
        return None, out
    a, b = tuple(mod.a.shape), tuple(mod.b.shape)
    configured = cfg.rank_for(name)
    if mod.embedding:
        if len(a) != 2 or len(b) != 2:
            out.append(
                finding(
                    "AB_SHAPE_MISMATCH",
                    name,
                    f"embedding factors must be matrices, got {a_name} {list(a)} and {b_name} {list(b)}.",
                    a_shape=list(a),
                    b_shape=list(b),
                )
            )
            return None, out
        if a[0] == b[1]:
            geo = Geometry("embedding", a[0], b[0], a[1], a)
        elif a[1] == b[0]:
            out.append(
                finding(
                    "EMBEDDING_ORIENTATION",
                    name,
                    f"{a_name} is {list(a)} and {b_name} is {list(b)}: stored transposed. PEFT expects "
                    f"{a_name} as r x vocab and {b_name} as dim x r (here {[a[1], a[0]]} and "
                    f"{[b[1], b[0]]}) and fails to load this — transpose both tensors.",
                    a_shape=list(a),
                    b_shape=list(b),
                )
            )
            geo = Geometry("embedding", a[1], b[1], a[0], (a[1], a[0]), transposed_factors=True)
        else:
            out.append(
                finding(
                    "AB_SHAPE_MISMATCH",
                    name,
                    f"{a_name} {list(a)} and {b_name} {list(b)} share no rank dimension; the module "
                    "cannot be applied — re-export the adapter.",
                    a_shape=list(a),
                    b_shape=list(b),
                )
            )
            return None, out
    else:
        conv_ok = len(a) >= 2 and len(b) >= 2 and all(d == 1 for d in b[2:]) and len(a) == len(b)
        if not conv_ok or a[0] != b[1]:
            hint = ""
            if len(a) == 2 and len(b) == 2 and a[1] == b[0]:
                hint = f" They look transposed (A {list(a)} as in x r, B {list(b)} as r x out)."
            out.append(
                finding(
                    "AB_SHAPE_MISMATCH",
                    name,
                    f"lora_A {list(a)} and lora_B {list(b)} do not multiply (A must be r x in, B out x r)."
                    f"{hint} The module cannot be applied — re-export the adapter.",
                    a_shape=list(a),
                    b_shape=list(b),
                )
            )
            return None, out
        inp = math.prod(a[1:])
        geo = Geometry("conv" if len(a) > 2 else "linear", a[0], b[0], inp, a)
    if geo.rank != configured:
        src = pattern_key(cfg.rank_pattern, name)
        where = f"rank_pattern[{src!r}]" if src is not None else "r"
        out.append(
            finding(
                "RANK_MISMATCH",
                name,
                f"the factors have rank {geo.rank} but the config says {where} = {configured}; PEFT "
                f"fails to load this module with a size mismatch — set {where} to {geo.rank}.",
                stored_rank=geo.rank,
                configured_rank=configured,
            )
        )
    return geo, out


def extras_findings(mod: LoraModule, geo: Geometry | None, cfg: LoraConfig) -> list[Finding]:
    """DoRA magnitude and lora_B.bias presence and shapes against the config."""
    name = mod.module
    out: list[Finding] = []
    has_factors = mod.a is not None or mod.b is not None
    if cfg.use_dora and has_factors and mod.magnitude is None:
        out.append(
            finding(
                "DORA_MAGNITUDE_MISSING",
                name,
                "use_dora is true but there is no lora_magnitude_vector; PEFT re-initialises the "
                "magnitude from the base weight and the trained DoRA scaling is lost — re-export it.",
            )
        )
    if mod.magnitude is not None and not cfg.use_dora:
        out.append(
            finding(
                "DORA_MAGNITUDE_UNEXPECTED",
                name,
                "lora_magnitude_vector is present but use_dora is false; PEFT ignores it and applies "
                "plain LoRA, not the trained DoRA update — set use_dora to true.",
                tensor=mod.magnitude.name,
            )
        )
    if mod.magnitude is not None and geo is not None and math.prod(mod.magnitude.shape) != geo.out:
        out.append(
            finding(
                "DORA_MAGNITUDE_SHAPE",
                name,
                f"lora_magnitude_vector has {math.prod(mod.magnitude.shape)} entries but the module "
                f"has {geo.out} outputs; PEFT fails to load it — re-export the adapter.",
                shape=list(mod.magnitude.shape),
                expected=geo.out,
            )
        )
    if mod.b_bias is not None and not cfg.lora_bias:
        out.append(
            finding(
                "LORA_BIAS_UNEXPECTED",
                name,
                "lora_B.bias is present but lora_bias is false; PEFT builds lora_B without a bias and "
                "drops the trained one — set lora_bias to true.",
                tensor=mod.b_bias.name,
            )
        )
    if mod.b_bias is not None and geo is not None and math.prod(mod.b_bias.shape) != geo.out:
        out.append(
            finding(
                "LORA_BIAS_SHAPE",
                name,
                f"lora_B.bias has {math.prod(mod.b_bias.shape)} entries but the module has {geo.out} "
                "outputs; PEFT fails to load it — re-export the adapter.",
                shape=list(mod.b_bias.shape),
                expected=geo.out,
            )
        )
    if cfg.lora_bias and mod.b is not None and mod.b_bias is None and not mod.embedding:
        out.append(
            finding(
                "LORA_BIAS_MISSING",
                name,
                "lora_bias is true but there is no lora_B.bias; PEFT starts it at zero, so the trained "
                "bias (if any) is lost.",
            )
        )
    return out


# -- config against the tensors --------------------------------------------------------------------
def naming_findings(lay: AdapterLayout, total: int) -> list[Finding]:
    out: list[Finding] = []
    lora_names = [t.name for m in lay.modules.values() for t in m.tensors]
    if not lay.modules:
        out.append(
            finding(
                "ADAPTER_EMPTY",
                None,
                f"the weights file holds {total} tensors and none is a LoRA factor "
                "(lora_A/lora_B/lora_embedding_A/B); there is nothing to apply — check the export.",
                tensors=total,
            )
        )
    unprefixed = [n for n in lay.unprefixed if n in set(lora_names)]
    if unprefixed:
        out.append(
            finding(
                "KEY_PREFIX_MISSING",
                None,
                f"{len(unprefixed)} of {len(lora_names)} LoRA tensors lack the {PEFT_PREFIX!r} prefix "
                f"(e.g. {unprefixed[0]!r}); PEFT matches none of them and silently loads the bare base "
                f"model — rename them to '{PEFT_PREFIX}<name>'.",
                count=len(unprefixed),
                examples=unprefixed[:EXAMPLES],
            )
        )
    if lay.adapter_named:
        out.append(
            finding(
                "KEY_ADAPTER_NAME",
                None,
                f"{len(lay.adapter_named)} tensor names still carry an adapter name (e.g. "
                f"{lay.adapter_named[0]!r}); PEFT inserts the name again on load, matches nothing and "
                "silently loads the bare base model — save with PeftModel.save_pretrained or drop the "
                "adapter-name component.",
                count=len(lay.adapter_named),
                examples=lay.adapter_named[:EXAMPLES],
            )
        )
    for name in lay.unrecognized:
        out.append(
            finding(
                "UNRECOGNIZED_TENSOR",
                None,
                f"tensor {name!r} is not a LoRA factor, DoRA magnitude, lora_B bias or full module "
                "weight; PEFT's LoRA loader ignores it — remove it or check which tool wrote it.",
                tensor=name,
            )
        )
    for name in lay.duplicates:
        out.append(
            finding(
                "UNRECOGNIZED_TENSOR",
                None,
                f"tensor {name!r} repeats a LoRA tensor already stored under another name; which one "
                "a runtime loads is undefined — keep one.",
                tensor=name,
            )
        )
    return out


def targeting_findings(cfg: LoraConfig, lay: AdapterLayout) -> list[Finding]:
    """target_modules, rank/alpha patterns and modules_to_save against the modules in the file."""
    out: list[Finding] = []
    modules = list(lay.modules)
    not_targeted = [m for m in modules if is_targeted(cfg, m, embedding=lay.modules[m].embedding) is False]
    for m in not_targeted:
        out.append(
            finding(
                "MODULE_NOT_TARGETED",
                m,
                f"the file has LoRA weights for this module but target_modules {cfg.target_modules!r} "
                "(with exclude_modules/layers_to_transform) does not select it; PEFT creates no LoRA "
                "layer here and silently drops these weights — add it to target_modules.",
                target_modules=cfg.target_modules,
            )
        )
    if isinstance(cfg.target_modules, list) and modules:
        for t in cfg.target_modules:
            if not any(m == t or m.endswith("." + t) for m in modules):
                out.append(
                    finding(
                        "TARGET_UNMATCHED",
                        None,
                        f"target_modules entry {t!r} matches no module with weights in the file; PEFT "
                        "will add untrained (zero) LoRA layers there if the base has such modules — "
                        "the export may be incomplete, or remove the entry.",
                        entry=t,
                    )
                )
    elif (
        isinstance(cfg.target_modules, str)
        and cfg.target_modules != "all-linear"
        and modules
        and not any(is_targeted(cfg, m) for m in modules)
    ):
        out.append(
            finding(
                "TARGET_UNMATCHED",
                None,
                f"the target_modules regex {cfg.target_modules!r} matches no module with weights in "
                "the file — fix the regex.",
                entry=cfg.target_modules,
            )
        )
    for key, table in (("rank_pattern", cfg.rank_pattern), ("alpha_pattern", cfg.alpha_pattern)):
        matched = pattern_table(table).matched(list(modules)) if table else set()
        for i, pat in enumerate(table):
            if i not in matched:
                out.append(
                    finding(
                        "PATTERN_UNMATCHED",
                        None,
                        f"{key} key {pat!r} matches no adapted module (PEFT matches it against a "
                        "dot-separated suffix of the module name), so its value "
                        f"{table[pat]!r} is silently unused — fix the pattern.",
                        key=key,
                        pattern=pat,
                        value=table[pat],
                    )
                )
    saved_modules = [b.rsplit(".", 1)[0] for _, b in lay.full]
    for entry in cfg.modules_to_save:
        if not any(m == entry or m.endswith("." + entry) for m in saved_modules):
            out.append(
                finding(
                    "MODULES_TO_SAVE_MISSING",
                    None,
                    f"modules_to_save lists {entry!r} but the file has no weights for it; PEFT keeps the "
                    "base's untrained copy — re-export the adapter with that module's weights.",
                    entry=entry,
                )
            )
    if cfg.use_rslora and cfg.lora_alpha:
        r = cfg.r
        standard = cfg.lora_alpha / r
        rs = cfg.lora_alpha / math.sqrt(r)
        out.append(
            finding(
                "RSLORA_SCALING",
                None,
                f"use_rslora is true: updates are scaled by lora_alpha/√r = {rs:.4g}, not lora_alpha/r "
                f"= {standard:.4g} ({math.sqrt(r):.3g}x larger); a merge or serving tool that ignores "
                "use_rslora applies this adapter that much too weakly.",
                scaling=rs,
                standard_scaling=standard,
                ratio=math.sqrt(r),
            )
        )
    if cfg.base_model_name_or_path is None:
        out.append(
            finding(
                "BASE_UNDECLARED",
                None,
                "adapter_config.json does not name its base model (base_model_name_or_path); nobody can "
                "check the adapter is applied to the model it was trained on — set it.",
            )
        )
    return out


def full_tensor_findings(cfg: LoraConfig, lay: AdapterLayout) -> list[Finding]:
    """Full tensors (modules_to_save, biases, saved embeddings) that PEFT would not expect."""
    out: list[Finding] = []
    for t, base_name in lay.full:
        leaf = base_name.rsplit(".", 1)[-1]
        if module_to_save(cfg, base_name):
            continue
        if leaf == "bias" and cfg.bias in ("all", "lora_only"):
            continue
        if ".base_layer." in t.name or any(e in base_name for e in EMBEDDING_OR_HEAD_PARTS):
            continue  # embedding layers saved with save_embedding_layers
        out.append(
            finding(
                "UNRECOGNIZED_TENSOR",
                None,
                f"full tensor {t.name!r} is not a LoRA tensor and its module is not in modules_to_save; "
                "PEFT may load it over the base weight while other runtimes ignore it — list the module "
                "in modules_to_save or remove the tensor.",
                tensor=t.name,
            )
        )
    return out
