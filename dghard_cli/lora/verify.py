"""``dghard verify`` of a PEFT adapter directory: its config, weights, report and (given) BASE.

Checked, each failure an InputError naming the file, key, module or tensor:

- ``adapter_config.json`` parses, is a LoRA config, and no key that changes the weights' meaning
  is invalid;
- ``adapter_model.safetensors``' header is consistent; every tensor has a PEFT name; each module
  has A and B whose rank is the config's ``r``/``rank_pattern`` for it, is targeted by the config,
  and has a ``lora_magnitude_vector`` (one per output row) exactly when ``use_dora`` is set;
- deep: every float tensor is finite and the reference ``safetensors`` library sees the same names;
- with ``dghard_report.json``: each file it records has its size (and, deep, its sha256), the
  config equals the one it records, and its ``adapter`` section (modules, ranks, DoRA) matches;
- with BASE: the adapter read against BASE (shapes of every targeted module, magnitude vectors,
  full tensors' shapes), as ``repair``/``merge`` read it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dghard_cli.errors import InputError
from dghard_cli.io.checkpoint import Checkpoint, allowed_root, read_json_file
from dghard_cli.io.files import REPORT_LIMIT
from dghard_cli.io.output import file_sha256
from dghard_cli.io.safetensors_format import FLOAT_DTYPES
from dghard_cli.lora.adapter import ADAPTER_WEIGHTS, classify_tensors, open_adapter
from dghard_cli.lora.config import ADAPTER_CONFIG, parse_config
from dghard_cli.lora.reading import WEIGHT_KEYS
from dghard_cli.lora.targets import is_targeted

REPORT_NAME = "dghard_report.json"


def verify_adapter_dir(path: Path, *, deep: bool, base: Checkpoint | None = None) -> dict:
    """Verify an adapter directory (module docstring); returns verify's document."""
    path = Path(path)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (path / name).is_file():
            raise InputError(
                f"{path / name}: missing (an adapter directory holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})"
            )
    adapter = open_adapter(str(path))
    checks = ["adapter config", "weights header"]
    try:
        cfg, findings = parse_config(adapter.config_raw, str(path / ADAPTER_CONFIG))
        for f in findings:
            if f.code == "CONFIG_INVALID" and f.details.get("key") in WEIGHT_KEYS:
                raise InputError(f"{path / ADAPTER_CONFIG}: {f.message}")
        tensors = list(adapter.weights.tensors.values())
        lay = classify_tensors(tensors)
        bad = lay.unprefixed + lay.adapter_named + lay.unrecognized + lay.duplicates
        if bad:
            raise InputError(f"{path / ADAPTER_WEIGHTS}: tensor {bad[0]!r} is not a tensor PEFT loads")
        checks.append("ranks, targets and DoRA against the config")
        ranks: dict[str, int] = {}
        for module, lm in lay.modules.items():
            at = f"{path / ADAPTER_WEIGHTS}: module {module!r}"
            if lm.a is None or lm.b is None:
                raise InputError(f"{at} has no {'lora_A' if lm.a is None else 'lora_B'} tensor")
            if len(lm.a.shape) != 2 or len(lm.b.shape) != 2 or lm.a.shape[0] != lm.b.shape[1]:
                raise InputError(
                    f"{at}: lora_A {list(lm.a.shape)} and lora_B {list(lm.b.shape)} do not form B·A"
                )
            r, declared = lm.a.shape[0], cfg.rank_for(module)
            if r != declared:
                raise InputError(f"{at}: the factors have rank {r} but {ADAPTER_CONFIG} gives r = {declared}")
            if is_targeted(cfg, module, embedding=lm.embedding) is False:
                raise InputError(f"{at} is not among the config's target_modules; PEFT would not load it")
            if cfg.use_dora and lm.magnitude is None:
                raise InputError(f"{at}: use_dora is set but it has no lora_magnitude_vector")
            if not cfg.use_dora and lm.magnitude is not None:
                raise InputError(f"{at} has a lora_magnitude_vector but use_dora is false")
            out_rows = lm.b.shape[0]
            if lm.magnitude is not None and lm.magnitude.numel != out_rows:
                raise InputError(
                    f"{at}: lora_magnitude_vector has {lm.magnitude.numel} entries, not {out_rows}"
                )
            ranks[module] = r
        if isinstance(cfg.target_modules, list):
            for entry in cfg.target_modules:
                if not any(m == entry or m.endswith("." + entry) for m in ranks):
                    raise InputError(
                        f"{path / ADAPTER_CONFIG}: target_modules names {entry!r}, but "
                        f"{ADAPTER_WEIGHTS} holds no LoRA factors for it"
                    )
        if deep:
            checks += ["safetensors library", "finite values"]
            from safetensors import safe_open

            with safe_open(str(path / ADAPTER_WEIGHTS), framework="pt") as fh:
                if set(fh.keys()) != set(adapter.weights.tensors):
                    raise InputError(f"{path / ADAPTER_WEIGHTS}: the safetensors library sees other tensors")
            for t in tensors:
                if t.dtype in FLOAT_DTYPES and not bool(torch.isfinite(t.read()).all()):
                    raise InputError(f"{path / ADAPTER_WEIGHTS}: tensor {t.name!r} contains NaN or Inf")
        if (path / REPORT_NAME).exists():
            checks += _check_report(path, adapter.config_raw, ranks, cfg.use_dora, deep)
        if base is not None:
            checks.append(f"shapes against BASE {base.source}")
            _check_base(adapter, base)
    finally:
        adapter.weights.close()
    return {
        "path": str(path),
        "ok": True,
        "kind": "peft-lora",
        "shards": 1,
        "tensors": len(tensors),
        "modules": len(ranks),
        "bytes": adapter.weights.total_bytes,
        "index": False,
        "checks": checks,
        "skipped": [] if deep else ["sha256 of the files", "safetensors library", "NaN/Inf scan"],
    }


def _check_report(path: Path, config: dict, ranks: dict[str, int], dora: bool, deep: bool) -> list[str]:
    report = read_json_file(path / REPORT_NAME, "report", limit=REPORT_LIMIT, roots=allowed_root(path))
    where = path / REPORT_NAME
    if not isinstance(report, dict) or (report.get("output") or {}).get("format") != "peft":
        raise InputError(f"{where}: not the report of an adapter output (output.format is not 'peft')")
    checks = []
    files = (report.get("output") or {}).get("files") or []
    for f in files:
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or "/" in f["name"]:
            raise InputError(f"{where}: names a file this directory cannot hold ({f!r})")
        p = path / f["name"]
        if not p.is_file():
            raise InputError(f"{p}: recorded in the report but missing")
        if p.stat().st_size != f.get("size"):
            raise InputError(f"{p}: size {p.stat().st_size} differs from the recorded {f.get('size')}")
        if deep and file_sha256(p) != f.get("sha256"):
            raise InputError(f"{p}: sha256 differs from the one recorded when it was written")
    if files:
        checks.append("file sizes and sha256" if deep else "file sizes (sha256 not checked: --quick)")
    if "adapter_config" in report and report["adapter_config"] != config:
        raise InputError(f"{path / ADAPTER_CONFIG}: differs from the config the report records")
    a = report.get("adapter")
    if not isinstance(a, dict):
        raise InputError(f"{where}: has no adapter section")
    want = {
        "lora_modules": len(ranks),
        "rank_max": max(ranks.values()) if ranks else None,
        "dora": dora,
    }
    for key, value in want.items():
        if key in a and a[key] != value:
            raise InputError(f"{where}: adapter.{key} is {a[key]!r}, but the adapter holds {value!r}")
    for rec in report.get("tensors") or []:
        if isinstance(rec, dict) and rec.get("written_as") == "lora":
            m = rec.get("written_on") or rec.get("module")
            if ranks.get(m) != rec.get("rank"):
                raise InputError(
                    f"{where}: module {m!r} is recorded at rank {rec.get('rank')}, held at {ranks.get(m)}"
                )
    if a.get("exact") is False and not a.get("cut_by"):
        raise InputError(f"{where}: the adapter is recorded lossy without the option that asked for it")
    checks.append("report's adapter fields")
    return checks


def _check_base(adapter, base: Checkpoint) -> None:
    from dghard_cli.lora.source import AdapterCheckpoint, check_base

    check_base(base)
    view = AdapterCheckpoint(adapter, base, label="adapter")
    for name, info in view.full.items():
        b = base.tensors[name]
        if tuple(info.shape) != tuple(b.shape):
            raise InputError(
                f"{adapter.path / ADAPTER_WEIGHTS}: full tensor {info.name!r} is {list(info.shape)}, BASE's "
                f"{name!r} is {list(b.shape)}"
            )


def is_adapter_dir(path: Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()
