"""``dghard audit-lora``: audit a PEFT LoRA adapter before anyone merges or serves it.

:func:`audit_lora` returns a findings document (schema in the README): every check is a small
function that turns config, names, shapes or numbers into :class:`~dghard_cli.lora.findings.Finding`
objects, so each can be tested on its own. The adapter's tensors are read one module at a time
(factors are ``r x n``: small); with ``--base`` the base is streamed one weight at a time, tall
weights in row blocks.

The checks, by step: :mod:`.config_checks` (config against tensor names and shapes),
:mod:`.tensor_checks` (values of the factors), :mod:`.base_checks` (against ``--base``);
this module runs them and assembles the document.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from dghard_cli._version import __version__
from dghard_cli.audit.base_checks import TINY_VS_BASE, AuditRun, audit_against_base, torch_threads
from dghard_cli.audit.config_checks import (
    Geometry,
    extras_findings,
    full_tensor_findings,
    module_geometry,
    naming_findings,
    targeting_findings,
)
from dghard_cli.audit.tensor_checks import (
    TINY_VS_PEERS,
    ModuleValues,
    dtype_finding,
    extra_value_findings,
    module_values,
    nonfinite_counts,
    nonfinite_finding,
    peer_tiny_findings,
)
from dghard_cli.engine.device import resolve_device
from dghard_cli.errors import InputError
from dghard_cli.io.safetensors_format import FLOAT_DTYPES
from dghard_cli.lora.adapter import classify_tensors, open_adapter
from dghard_cli.lora.config import LoraConfig, parse_config
from dghard_cli.lora.findings import (
    CODES,
    LEVELS,
    Finding,
    finding,
    natural_key,
    reaches,
    sort_findings,
)

SCHEMA_VERSION = 1


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
    run = AuditRun()
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
                run.findings.append(dtype_finding(None, ti))
                continue
            nan, inf = nonfinite_counts(ti, o.block_bytes)
            if nan or inf:
                run.findings.append(nonfinite_finding(None, ti.name, nan, inf, ti.numel))
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
            base_doc = audit_against_base(run, o, cfg, lay, geos, values, base)
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


def _document(
    run: AuditRun,
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
