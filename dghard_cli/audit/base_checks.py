"""Checks against the base model (``--base``): the declared base's identity, module shapes, the
update's size next to the base weights (``‖ΔW‖ / ‖W‖``), and intruder dimensions (top singular
vectors of ``W_base + ΔW`` far from every base singular vector)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dghard_cli.architecture import VOCAB_LEAVES
from dghard_cli.audit.config_checks import (
    Geometry,
)
from dghard_cli.audit.tensor_checks import (
    ModuleValues,
    read_factors,
)
from dghard_cli.engine.device import resolve_device
from dghard_cli.io.checkpoint import Checkpoint, TensorInfo
from dghard_cli.io.safetensors_format import FLOAT_DTYPES
from dghard_cli.lora.adapter import AdapterLayout
from dghard_cli.lora.config import LoraConfig
from dghard_cli.lora.findings import (
    EXAMPLES,
    Finding,
    finding,
    natural_key,
)
from dghard_cli.lora.spectra import (
    BlockSource,
    intruder_dimensions,
)
from dghard_cli.lora.targets import is_targeted

if TYPE_CHECKING:  # the options are defined with the audit, which calls these checks
    from dghard_cli.audit.auditor import AuditOptions


#: ‖ΔW‖_F / ‖W_base‖_F below this is a no-op update (a 0.01 % change of every output).
TINY_VS_BASE = 1e-4


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
class AuditRun:
    findings: list[Finding] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)
    timings: dict = field(default_factory=dict)


def audit_against_base(
    run: AuditRun,
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
