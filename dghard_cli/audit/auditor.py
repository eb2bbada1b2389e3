"""``dghard audit-lora``: audit a PEFT LoRA adapter before anyone merges or serves it.

:func:`audit_lora` returns a findings document (schema in the README): every check is a small
function that turns config, names, shapes or numbers into :class:`~dghard_cli.audit.findings.Finding`
objects, so each can be tested on its own. The adapter's tensors are read one module at a time
(factors are ``r x n``: small); with ``--base`` the base is streamed one weight at a time, tall
weights in row blocks.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dghard_cli import __version__
from dghard_cli.architecture import EMBEDDING_OR_HEAD_PARTS, VOCAB_LEAVES
from dghard_cli.audit.findings import CODES, LEVELS, Finding, finding, natural_key, reaches, sort_findings
from dghard_cli.engine.device import resolve_device
from dghard_cli.errors import InputError
from dghard_cli.io.checkpoint import Checkpoint, TensorInfo
from dghard_cli.io.lora_adapter import (
    PEFT_PREFIX,
    AdapterLayout,
    LoraConfig,
    LoraModule,
    classify_tensors,
    is_targeted,
    module_to_save,
    open_adapter,
    parse_config,
    pattern_key,
)
from dghard_cli.io.safetensors_format import FLOAT_DTYPES, UNIT_ROUNDOFF
from dghard_cli.spectral.lora import (
    BlockSource,
    intruder_dimensions,
    lowrank_spectrum,
    spectrum_stats,
)

SCHEMA_VERSION = 1
#: ‖ΔW‖_F / ‖W_base‖_F below this is a no-op update (a 0.01 % change of every output).
TINY_VS_BASE = 1e-4
#: RMS of a module's update below this fraction of the median over its peers (same module
#: name in other layers) is a no-op update next to the rest of the adapter.
TINY_VS_PEERS = 1e-3
#: Examples listed in an aggregated finding's message.
EXAMPLES = 3


@dataclass
class AuditOptions:
    fail_on: str = "error"
    top_k: int = 10
    epsilon: float = 0.5
    revision: str | None = None
    base_revision: str | None = None
    device: str = "auto"
    tiny_vs_base: float = TINY_VS_BASE
    tiny_vs_peers: float = TINY_VS_PEERS
    block_bytes: int = 128 * 1024 * 1024
    progress: bool = False


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
        for pat in table:
            if not any(pattern_key({pat: 0}, m) is not None for m in modules):
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


# -- values ------------------------------------------------------------------------------------------
def nonfinite_counts(ti: TensorInfo, block_bytes: int) -> tuple[int, int]:
    """(NaN count, Inf count) of a float tensor, read in row blocks."""
    nan = inf = 0
    rows = ti.shape[0] if ti.shape else 1
    step = max(1, block_bytes // max(1, ti.row_bytes)) if ti.shape else 1
    for r0 in range(0, rows, step) if ti.shape else [None]:
        x = ti.read((r0, min(rows, r0 + step))) if r0 is not None else ti.read()
        if x.is_floating_point():
            nan += int(torch.isnan(x).sum())
            inf += int(torch.isinf(x).sum())
    return nan, inf


def _nonfinite_finding(module: str | None, tensor: str, nan: int, inf: int, total: int) -> Finding:
    return finding(
        "NONFINITE",
        module,
        f"{tensor.rsplit('.', 2)[-2] if module else tensor} has {nan} NaN and {inf} Inf values (of "
        f"{total}); every output through it becomes NaN/Inf — restore the weights from an earlier "
        "checkpoint or retrain.",
        tensor=tensor,
        nan=nan,
        inf=inf,
    )


def _dtype_finding(module: str | None, ti: TensorInfo) -> Finding:
    return finding(
        "NON_FLOAT_TENSOR",
        module,
        f"{ti.name} is stored as {ti.dtype}; LoRA tensors must be floating point (quantised factors "
        "are not a PEFT LoRA format) — re-export in float32, bfloat16 or float16.",
        tensor=ti.name,
        dtype=ti.dtype,
    )


@dataclass
class ModuleValues:
    """What the factors of one module measure (the factors themselves are not kept)."""

    scaling: float | None
    stats: dict
    zero: bool


def read_factors(mod: LoraModule, geo: Geometry) -> tuple[torch.Tensor, torch.Tensor]:
    """B (``out x r``) and A (``r x in``) as float64, in PEFT's orientation."""
    a = mod.a.read().to(torch.float64)
    b = mod.b.read().to(torch.float64)
    if geo.transposed_factors:
        a, b = a.T, b.T
    return b.reshape(geo.out, geo.rank), a.reshape(geo.rank, -1)


def sum_of_squares(x: torch.Tensor) -> float:
    """Σx² in one pass: NaN if x has a NaN, Inf if it has an Inf, 0 iff every entry is 0 (float64
    has the range to square any float32/bf16/fp16 value without underflow or overflow)."""
    v = x.reshape(-1)
    return float(torch.dot(v, v)) if v.numel() else 0.0


def module_values(
    mod: LoraModule, geo: Geometry, cfg: LoraConfig
) -> tuple[ModuleValues | None, list[Finding]]:
    """Read A and B, check finiteness and zeros, and compute the spectrum of scaling·B·A."""
    out: list[Finding] = []
    name = mod.module
    bad = False
    for ti in (mod.a, mod.b):
        if ti.dtype not in FLOAT_DTYPES:
            out.append(_dtype_finding(name, ti))
            bad = True
    if bad:
        return None, out
    b, a = read_factors(mod, geo)
    squares = {}
    for ti, x in ((mod.a, a), (mod.b, b)):
        ss = sum_of_squares(x)
        if not math.isfinite(ss):
            nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
            out.append(_nonfinite_finding(name, ti.name, nan, inf, x.numel()))
            bad = True
        squares[ti.name] = ss
    if bad:
        return None, out
    a_zero = squares[mod.a.name] == 0.0
    b_zero = squares[mod.b.name] == 0.0
    if a_zero:
        out.append(
            finding(
                "A_ALL_ZERO",
                name,
                "every entry of A is zero, so this module's update B·A is zero; PEFT never initialises "
                "A to zero — the export or a conversion step lost the weights.",
                tensor=mod.a.name,
            )
        )
    if b_zero:
        out.append(
            finding(
                "B_ALL_ZERO",
                name,
                "every entry of B is zero, so this module's update B·A is zero: it never trained "
                "(PEFT initialises B to zero) — check that the module received gradients (frozen, "
                "learning rate, saved too early).",
                tensor=mod.b.name,
            )
        )
    scaling = cfg.scaling_for(name)
    spec = lowrank_spectrum(b, a, scaling if scaling is not None else 1.0)
    u = max(UNIT_ROUNDOFF.get(mod.a.dtype, 2.0**-24), UNIT_ROUNDOFF.get(mod.b.dtype, 2.0**-24))
    stats = spectrum_stats(spec, u)
    zero = a_zero or b_zero or stats["delta_norm"] == 0.0
    if not zero and stats["numerical_rank"] < geo.rank:
        out.append(
            finding(
                "RANK_DEFICIENT",
                name,
                f"only {stats['numerical_rank']} of the {geo.rank} directions of B·A stand above the "
                f"rounding of its {mod.b.dtype} factors; the rest are dead (never trained or collapsed) — "
                f"a rank-{max(1, stats['numerical_rank'])} adapter would do the same.",
                numerical_rank=stats["numerical_rank"],
                rank=geo.rank,
            )
        )
    return ModuleValues(scaling=scaling, stats=stats, zero=zero), out


def extra_value_findings(mod: LoraModule, block_bytes: int) -> list[Finding]:
    """Finiteness of the DoRA magnitude and lora_B.bias; non-positive magnitudes."""
    out: list[Finding] = []
    for ti in (mod.magnitude, mod.b_bias):
        if ti is None:
            continue
        if ti.dtype not in FLOAT_DTYPES:
            out.append(_dtype_finding(mod.module, ti))
            continue
        x = ti.read().to(torch.float64)
        nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
        if nan or inf:
            out.append(_nonfinite_finding(mod.module, ti.name, nan, inf, x.numel()))
            continue
        if ti is mod.magnitude:
            bad = int((x <= 0).sum())
            if bad:
                out.append(
                    finding(
                        "DORA_MAGNITUDE_NONPOSITIVE",
                        mod.module,
                        f"{bad} of {x.numel()} DoRA magnitudes are zero or negative; those output rows "
                        "are switched off or sign-flipped — check the training run.",
                        count=bad,
                        min=float(x.min()),
                    )
                )
    return out


def peer_tiny_findings(records: list[dict], ratio: float) -> list[Finding]:
    """Modules whose update RMS is below ``ratio`` x the median of their peers (no ``--base``)."""
    live = [r for r in records if r.get("delta_rms")]
    if len(live) < 3:
        return []
    by_leaf: dict[str, list[float]] = {}
    for r in live:
        by_leaf.setdefault(r["module"].rsplit(".", 1)[-1], []).append(r["delta_rms"])
    overall = statistics.median(r["delta_rms"] for r in live)
    out = []
    for r in live:
        peers = by_leaf[r["module"].rsplit(".", 1)[-1]]
        ref = statistics.median(peers) if len(peers) >= 3 else overall
        if r["delta_rms"] < ratio * ref:
            out.append(
                finding(
                    "DELTA_TINY",
                    r["module"],
                    f"this module's update is {r['delta_rms'] / ref:.2g}x the typical size of its peers "
                    f"(RMS {r['delta_rms']:.3g} vs median {ref:.3g}); it barely changes the model — it may "
                    "not have trained.",
                    basis="peers",
                    ratio=r["delta_rms"] / ref,
                    delta_rms=r["delta_rms"],
                    median_rms=ref,
                )
            )
    return out


# -- the base ------------------------------------------------------------------------------------------
def _norm_id(s: str) -> str:
    return s.strip().rstrip("/").lower()


def base_identity_findings(
    cfg: LoraConfig, base_spec: str, base_path: Path, base_revision: str | None, base_config: dict | None
) -> list[Finding]:
    """Declared base_model_name_or_path / revision against the base given."""
    out: list[Finding] = []
    declared = cfg.base_model_name_or_path
    if declared:
        given = [base_spec, str(base_path), base_path.name]
        if base_config and isinstance(base_config.get("_name_or_path"), str):
            given.append(base_config["_name_or_path"])
        d = _norm_id(declared)
        d_last = d.split("/")[-1]
        ok = any(_norm_id(g) == d or _norm_id(g).split("/")[-1] == d_last for g in given if g)
        if not ok:
            out.append(
                finding(
                    "BASE_NAME_MISMATCH",
                    None,
                    f"the adapter declares base {declared!r} but --base is {base_spec!r}; an adapter "
                    "applied to another base computes something else — pass the declared base, or fix "
                    "base_model_name_or_path if this is the same model under another name.",
                    declared=declared,
                    given=base_spec,
                )
            )
    if cfg.revision:
        if base_revision and base_revision != cfg.revision:
            out.append(
                finding(
                    "BASE_REVISION_MISMATCH",
                    None,
                    f"the adapter was trained on revision {cfg.revision!r} of its base but "
                    f"--base-revision is {base_revision!r} — audit and serve it with --base-revision "
                    f"{cfg.revision}.",
                    declared=cfg.revision,
                    given=base_revision,
                )
            )
        elif not base_revision:
            out.append(
                finding(
                    "BASE_REVISION_UNVERIFIED",
                    None,
                    f"the adapter pins base revision {cfg.revision!r} but no --base-revision was given, "
                    f"so the base used here may be another version — pass --base-revision {cfg.revision}.",
                    declared=cfg.revision,
                )
            )
    return out


def resolve_base_name(name: str, base_names: dict) -> str | None:
    """The base tensor for an adapter-side name: exact, then without leading components, then a
    unique name that ends with it (a base saved with another wrapper prefix)."""
    if name in base_names:
        return name
    parts = name.split(".")
    for i in range(1, len(parts) - 1):
        cand = ".".join(parts[i:])
        if cand in base_names:
            return cand
    hits = [n for n in base_names if n.endswith("." + name)]
    return hits[0] if len(hits) == 1 else None


def expected_base_shapes(geo: Geometry, cfg: LoraConfig) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """The stored base shape the update fits, and the transposed alternative (2-D only)."""
    if geo.kind == "embedding":
        return (geo.inp, geo.out), None  # vocab x dim
    if geo.kind == "conv":
        return (geo.out, *geo.a_shape[1:]), None
    if cfg.fan_in_fan_out:
        return (geo.inp, geo.out), (geo.out, geo.inp)
    return (geo.out, geo.inp), (geo.inp, geo.out)


def base_blocks(ti: TensorInfo, transposed: bool, block_bytes: int) -> BlockSource:
    """Stream a base weight in PEFT orientation (``out x in``); tall stored axes by row blocks."""
    rows = ti.shape[0]
    cols = math.prod(ti.shape[1:])

    def gen(axis: int) -> Iterable[torch.Tensor]:
        if (axis == 0) != transposed:  # blocks along the stored rows: stream them
            step = max(1, block_bytes // max(1, cols * 8))
            for r0 in range(0, rows, step):
                r1 = min(rows, r0 + step)
                blk = ti.read((r0, r1)).reshape(r1 - r0, cols)
                yield blk.T if transposed else blk
        else:  # blocks along the stored columns: the stored matrix is read once, sliced
            full = ti.read().reshape(rows, cols)
            step = max(1, block_bytes // max(1, rows * 8))
            for c0 in range(0, cols, step):
                blk = full[:, c0 : c0 + step]
                yield blk.T if transposed else blk

    return gen


def base_sq_norm(ti: TensorInfo, block_bytes: int) -> float:
    total = 0.0
    rows = ti.shape[0]
    step = max(1, block_bytes // max(1, ti.row_bytes * 4))
    for r0 in range(0, rows, step):
        x = ti.read((r0, min(rows, r0 + step))).to(torch.float64)
        total += float((x * x).sum())
    return total


def missing_module_findings(cfg: LoraConfig, lay: AdapterLayout, base: Checkpoint) -> list[Finding]:
    """Base modules the config targets that have no adapter weights."""
    if cfg.target_modules is None or cfg.target_modules == "all-linear":
        return []
    have = set(lay.modules)
    have_tail = {m.split(".", 1)[-1] for m in have}
    missing = []
    for name, ti in base.tensors.items():
        if not name.endswith(".weight") or len(ti.shape) < 2:
            continue
        module = name[: -len(".weight")]
        if module in have or module in have_tail or module.split(".", 1)[-1] in have:
            continue
        if is_targeted(cfg, module):
            missing.append(module)
    if not missing:
        return []
    missing.sort(key=natural_key)
    return [
        finding(
            "MODULE_WEIGHTS_MISSING",
            None,
            f"{len(missing)} base modules selected by target_modules have no adapter weights (e.g. "
            f"{', '.join(missing[:EXAMPLES])}); PEFT adds untrained (zero) LoRA layers there — the "
            "export is probably incomplete.",
            count=len(missing),
            examples=missing[:10],
        )
    ]


#: Matrices with a smaller side up to this run their base spectra on one torch thread: an
#: intra-op thread team costs more than it saves on them (and far more on shared cores).
SMALL_SIDE = 1024


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[int]:
    """Run torch with ``n`` intra-op threads inside (None: unchanged); yields the previous count.

    The adapter's factors are thin (``out x r``): one torch thread per op and modules spread over
    Python worker threads (torch releases the GIL) is faster — measured here, a 18944 x 16 float64
    QR takes 1.9 ms on one thread and 40 ms on two when the cores are shared.
    """
    previous = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield previous
    finally:
        torch.set_num_threads(previous)


# -- the audit ------------------------------------------------------------------------------------------
@dataclass
class _Run:
    findings: list[Finding] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)
    timings: dict = field(default_factory=dict)


def _validate_options(o: AuditOptions) -> None:
    if o.fail_on not in LEVELS:
        raise InputError(f"--fail-on {o.fail_on!r} is not one of {', '.join(reversed(LEVELS))}")
    if not isinstance(o.top_k, int) or o.top_k < 0:
        raise InputError(f"--top-k {o.top_k!r} must be a whole number >= 0 (0 skips intruder dimensions)")
    if not (isinstance(o.epsilon, (int, float)) and 0.0 <= o.epsilon <= 1.0):
        raise InputError(f"--epsilon {o.epsilon!r} must be a cosine between 0 and 1")


def audit_lora(
    adapter: str,
    base: str | None = None,
    *,
    fail_on: str = "error",
    k: int = 10,
    eps: float = 0.5,
    revision: str | None = None,
    base_revision: str | None = None,
    device: str = "auto",
    progress: bool = False,
    options: AuditOptions | None = None,
) -> dict:
    """Audit a PEFT LoRA adapter (directory or Hub id), optionally against its base.

    Returns the findings document (``schema_version`` 1, see the README). Raises
    :class:`~dghard_cli.errors.InputError` for unreadable input (exit 2); a finding at or above
    ``fail_on`` sets ``summary.failed`` (the CLI exits 1).

    Example::

        from dghard_cli import audit_lora
        doc = audit_lora("my-adapter/", base="base/", fail_on="warn")
        print(doc["summary"]["verdict"], [f["code"] for f in doc["findings"]])
    """
    o = options or AuditOptions(
        fail_on=fail_on,
        top_k=k,
        epsilon=eps,
        revision=revision,
        base_revision=base_revision,
        device=device,
        progress=progress,
    )
    _validate_options(o)
    resolve_device(o.device)  # a bad --device fails before any work
    t0 = time.perf_counter()
    run = _Run()
    ad = open_adapter(adapter, revision=o.revision)
    try:
        cfg, cfg_findings = parse_config(ad.config_raw, str(ad.path / "adapter_config.json"))
        run.findings += cfg_findings
        lay = classify_tensors(list(ad.weights.tensors.values()))
        run.findings += naming_findings(lay, len(ad.weights.tensors))
        run.findings += targeting_findings(cfg, lay)
        run.findings += full_tensor_findings(cfg, lay)
        run.timings["open_s"] = time.perf_counter() - t0

        t1 = time.perf_counter()
        geos: dict[str, Geometry] = {}
        values: dict[str, ModuleValues] = {}

        def one(name: str) -> tuple[Geometry | None, ModuleValues | None, list[Finding]]:
            mod = lay.modules[name]
            geo, fs = module_geometry(mod, cfg)
            fs += extras_findings(mod, geo, cfg)
            fs += extra_value_findings(mod, o.block_bytes)
            vals = None
            if geo is not None:
                vals, more = module_values(mod, geo, cfg)
                fs += more
            return geo, vals, fs

        names = sorted(lay.modules, key=natural_key)
        with torch_threads(1) as cores, ThreadPoolExecutor(max_workers=max(1, min(8, cores))) as pool:
            for name, (geo, vals, fs) in zip(names, pool.map(one, names), strict=True):
                run.findings += fs
                if geo is not None:
                    geos[name] = geo
                if vals is not None:
                    values[name] = vals
        for ti in [t for t, _ in lay.full] + lay.tokens:
            if ti.dtype not in FLOAT_DTYPES:
                run.findings.append(_dtype_finding(None, ti))
                continue
            nan, inf = nonfinite_counts(ti, o.block_bytes)
            if nan or inf:
                run.findings.append(_nonfinite_finding(None, ti.name, nan, inf, ti.numel))
        run.timings["adapter_s"] = time.perf_counter() - t1

        for name, geo in geos.items():
            mod = lay.modules[name]
            rec: dict = {
                "module": name,
                "kind": geo.kind,
                "shape": [geo.out, geo.inp],
                "rank": geo.rank,
                "r": cfg.rank_for(name),
                "alpha": cfg.alpha_for(name),
                "scaling": cfg.scaling_for(name),
                "dtype": mod.a.dtype if mod.a.dtype == mod.b.dtype else f"{mod.a.dtype}/{mod.b.dtype}",
                "dora": mod.magnitude is not None,
                "lora_bias": mod.b_bias is not None,
                "base": None,
                "intruders": None,
            }
            v = values.get(name)
            if v is not None:
                rec.update(v.stats)
                rec["delta_rms"] = (
                    v.stats["delta_norm"] / math.sqrt(geo.out * geo.inp) if geo.out * geo.inp else 0.0
                )
            run.records.append(rec)

        base_doc = None
        if base is not None:
            t2 = time.perf_counter()
            base_doc = _audit_against_base(run, o, cfg, lay, geos, values, base)
            run.timings["base_s"] = time.perf_counter() - t2
        else:
            run.findings += peer_tiny_findings(run.records, o.tiny_vs_peers)

        if values and all(v.zero for v in values.values()) and not lay.full:
            run.findings.append(
                finding(
                    "ADAPTER_NOOP",
                    None,
                    f"all {len(values)} adapted modules have a zero update; this adapter changes nothing "
                    "— it was saved before training or its weights were lost.",
                    modules=len(values),
                )
            )
        adapter_doc = ad.describe()
    finally:
        ad.weights.close()
    run.timings["total_s"] = time.perf_counter() - t0
    return _document(run, o, cfg, adapter_doc, base_doc, adapter, base, len(lay.modules))


def _audit_against_base(
    run: _Run,
    o: AuditOptions,
    cfg: LoraConfig,
    lay: AdapterLayout,
    geos: dict[str, Geometry],
    values: dict[str, ModuleValues],
    base_spec: str,
) -> dict:
    from dghard_cli.io.hub import open_checkpoint

    dev = resolve_device(o.device)
    base = open_checkpoint(base_spec, revision=o.base_revision, label="base")
    try:
        run.findings += base_identity_findings(cfg, base_spec, base.path, o.base_revision, base.config())
        run.findings += missing_module_findings(cfg, lay, base)
        records = {r["module"]: r for r in run.records}
        todo = [(n, geos[n]) for n in sorted(geos, key=natural_key)]
        prog = None
        if o.progress:
            from dghard_cli.engine.progress import Progress

            total = 0
            for n, _ in todo:
                bn = resolve_base_name(n + ".weight", base.tensors)
                total += base.tensors[bn].nbytes if bn else 0
            prog = Progress(total, len(todo), label="audit-lora: base weights", what="to read")
        intruder_modules = []
        for name, geo in todo:
            rec = records[name]
            bn = resolve_base_name(name + ".weight", base.tensors)
            if bn is None:
                run.findings.append(
                    finding(
                        "BASE_MODULE_MISSING",
                        name,
                        f"the base has no tensor {name + '.weight'!r} for this module; the adapter was "
                        "made for another architecture or naming — check --base.",
                        expected=name + ".weight",
                    )
                )
                if prog:
                    prog.advance(0)
                continue
            ti = base.tensors[bn]
            expected, alt = expected_base_shapes(geo, cfg)
            transposed = geo.kind == "embedding" or (geo.kind == "linear" and cfg.fan_in_fan_out)
            if tuple(ti.shape) != expected:
                if alt is not None and tuple(ti.shape) == alt and expected != alt:
                    run.findings.append(
                        finding(
                            "FAN_IN_FAN_OUT_MISMATCH",
                            name,
                            f"the update fits base weight {bn} {list(ti.shape)} only transposed: "
                            f"fan_in_fan_out is {str(cfg.fan_in_fan_out).lower()} but the base stores "
                            f"this layer as {'out x in' if not transposed else 'in x out'}. PEFT corrects "
                            "this for known layer types with a warning; tools that trust the flag merge it "
                            f"transposed — set fan_in_fan_out to {str(not cfg.fan_in_fan_out).lower()}.",
                            base_tensor=bn,
                            base_shape=list(ti.shape),
                        )
                    )
                    transposed = not transposed
                else:
                    hint = ""
                    if geo.kind == "embedding" or name.rsplit(".", 1)[-1] in VOCAB_LEAVES:
                        hint = " (vocabulary resized? resize the base's embeddings first)"
                    run.findings.append(
                        finding(
                            "BASE_SHAPE_MISMATCH",
                            name,
                            f"the update is {list(expected)} but base weight {bn} is {list(ti.shape)}"
                            f"{hint}; PEFT fails to load the adapter on this base — check --base.",
                            base_tensor=bn,
                            base_shape=list(ti.shape),
                            expected=list(expected),
                        )
                    )
                    if prog:
                        prog.advance(ti.nbytes)
                    continue
            rec["base"] = {"tensor": bn, "shape": list(ti.shape), "dtype": ti.dtype, "transposed": transposed}
            v = values.get(name)
            if ti.dtype not in FLOAT_DTYPES or v is None:
                if prog:
                    prog.advance(ti.nbytes)
                continue
            mod = lay.modules[name]
            scale = v.scaling if v.scaling is not None else 1.0
            if o.top_k > 0:
                mag = None
                if mod.magnitude is not None and math.prod(mod.magnitude.shape) == geo.out:
                    mag = mod.magnitude.read().to(torch.float64).reshape(-1)
                    if not torch.isfinite(mag).all():
                        mag = None
                b, a = read_factors(mod, geo)
                small = dev.type == "cpu" and min(geo.out, geo.inp) <= SMALL_SIDE
                with torch_threads(1 if small else None):
                    res = intruder_dimensions(
                        base_blocks(ti, transposed, o.block_bytes),
                        (geo.out, geo.inp),
                        b * scale,
                        a,
                        k=o.top_k,
                        epsilon=o.epsilon,
                        magnitude=mag,
                        device=dev,
                    )
                rec["intruders"] = res.to_dict()
                base_norm, delta_norm = res.base_norm, res.delta_norm
                if res.count:
                    intruder_modules.append((name, res))
            else:
                base_norm, delta_norm = math.sqrt(base_sq_norm(ti, o.block_bytes)), v.stats["delta_norm"]
            rel = delta_norm / base_norm if base_norm > 0 else None
            rec["base"].update({"norm": base_norm, "relative_norm": rel})
            if rel is not None and not v.zero and rel < o.tiny_vs_base:
                run.findings.append(
                    finding(
                        "DELTA_TINY",
                        name,
                        f"‖ΔW‖/‖W_base‖ = {rel:.2g}: the update changes this layer by less than "
                        f"{o.tiny_vs_base:.0e} of its size, so it is a no-op — check lora_alpha and the training run.",
                        basis="base",
                        relative_norm=rel,
                    )
                )
            if prog:
                prog.advance(ti.nbytes)
        if prog:
            prog.close()
        for t, bname in lay.full:
            bn = resolve_base_name(bname, base.tensors)
            if bn is not None and tuple(base.tensors[bn].shape) != tuple(t.shape):
                run.findings.append(
                    finding(
                        "BASE_SHAPE_MISMATCH",
                        bname.rsplit(".", 1)[0],
                        f"saved tensor {t.name} is {list(t.shape)} but base {bn} is "
                        f"{list(base.tensors[bn].shape)}; PEFT fails to load it on this base"
                        + (
                            " (vocabulary resized? resize the base's embeddings first)"
                            if t.shape[1:] == base.tensors[bn].shape[1:]
                            else ""
                        )
                        + ".",
                        base_tensor=bn,
                        base_shape=list(base.tensors[bn].shape),
                        shape=list(t.shape),
                    )
                )
        if intruder_modules:
            total = sum(r.count for _, r in intruder_modules)
            worst_name, worst = max(intruder_modules, key=lambda x: (x[1].count, -min(x[1].max_cos)))
            analysed = sum(1 for r in run.records if r.get("intruders"))
            run.findings.append(
                finding(
                    "INTRUDER_DIMENSIONS",
                    worst_name,
                    f"{len(intruder_modules)} of {analysed} modules have intruder dimensions ({total} in "
                    f"all; most here: {worst.count} of the top {worst.k}): top singular directions of "
                    f"W_base + ΔW with |cos| < {o.epsilon} to every base singular vector. They are linked "
                    "to forgetting of what the base knew; scaling their singular values down limits it "
                    "(Shuttleworth et al. 2024).",
                    modules=len(intruder_modules),
                    analysed=analysed,
                    total=total,
                    worst=worst.count,
                )
            )
        return {**base.describe(), "device": str(dev)}
    finally:
        base.close()


def _document(
    run: _Run,
    o: AuditOptions,
    cfg: LoraConfig,
    adapter_doc: dict,
    base_doc: dict | None,
    adapter: str,
    base: str | None,
    n_modules: int,
) -> dict:
    items = sort_findings(run.findings)
    counts = {lvl: sum(1 for f in items if f.level == lvl) for lvl in LEVELS}
    codes: dict[str, int] = {}
    for f in items:
        codes[f.code] = codes.get(f.code, 0) + 1
    worst = next((lvl for lvl in reversed(LEVELS) if counts[lvl]), None)
    failing = [f for f in items if reaches(f.level, o.fail_on)]
    failed = bool(failing)
    verdict = f"FAIL: {len(failing)} finding(s) at or above {o.fail_on}" if failed else "PASS"
    doc = {
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": "dghard", "version": __version__},
        "command": "audit-lora",
        "adapter": adapter_doc,
        "base": base_doc,
        "config": cfg.summary(),
        "parameters": {
            "fail_on": o.fail_on,
            "top_k": o.top_k,
            "epsilon": o.epsilon,
            "tiny_vs_base": o.tiny_vs_base,
            "tiny_vs_peers": o.tiny_vs_peers,
        },
        "summary": {
            "modules": n_modules,
            "errors": counts["error"],
            "warnings": counts["warn"],
            "infos": counts["info"],
            "worst": worst,
            "codes": codes,
            "failed": failed,
            "exit_code": 1 if failed else 0,
            "verdict": verdict,
        },
        "findings": [f.to_dict() for f in items],
        "modules": run.records,
        "timings": {k: round(v, 4) for k, v in run.timings.items()},
    }
    return _clean(doc)


def _clean(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, (np.floating, np.integer)):
        return _clean(obj.item())
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


__all__ = ["audit_lora", "AuditOptions", "CODES", "SCHEMA_VERSION"]
