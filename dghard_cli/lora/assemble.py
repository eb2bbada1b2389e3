"""Assembling an adapter output from its computed units: PEFT's key names, ``modules_to_save``,
``base_layer`` biases, a tied output layer's update moved onto the input embedding, and the
``adapter_config.json`` (rank/alpha patterns) with the summary the report carries.

:func:`assemble` reads the run's :class:`~dghard_cli.lora.context.RouteContext` (BASE, the
fine-tunes, the route, ``--rank``) and the units a route spooled into the staging directory.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

import torch

from dghard_cli.architecture import OUTPUT_HEAD, VOCAB_EMBEDDING, loaded_module_name
from dghard_cli.errors import InputError, RuntimeFailure
from dghard_cli.io.checkpoint import Checkpoint, TensorInfo
from dghard_cli.io.safetensors_format import torch_dtype
from dghard_cli.lora.adapter import PEFT_PREFIX
from dghard_cli.lora.context import RouteContext
from dghard_cli.lora.source import CONV1D_MODEL_TYPES, AdapterCheckpoint
from dghard_cli.lora.writer import (
    AdapterStage,
    adapter_config,
    check_modules_to_save,
    lora_keys,
    module_names,
)

#: The input embeddings whose LoRA PEFT 0.21 ties to the output layer (``ensure_weight_tying``
#: compares the last component of a ``target_modules`` entry with these names).
PEFT_TIED_EMBEDDINGS = ("embed_tokens",)


def ties_embeddings(ck: Checkpoint) -> bool:
    cfg = ck.config() or {}
    tie = bool(cfg.get("tie_word_embeddings", False))
    text = cfg.get("text_config")
    if isinstance(text, dict) and "tie_word_embeddings" in text:
        tie = tie or bool(text["tie_word_embeddings"])
    return tie


def base_reference(base: Checkpoint) -> tuple[str, str]:
    """How the adapter names its base (``base_model_name_or_path``) and which kind that is.

    A Hub id stays a Hub id (``hub id``); a directory is recorded as its absolute path
    (``absolute path``), so PEFT finds it from any working directory -- the command-line string
    (``base``, ``../models/base``) means something only where the command ran.
    """
    given = Path(base.source).expanduser()
    if given.is_dir() and given.resolve() == base.path.resolve():
        return str(given.resolve()), "absolute path"
    return base.source, "hub id"


def assemble(
    ctx: RouteContext, stage: AdapterStage, units: list[tuple[int, dict]]
) -> tuple[list, dict, dict]:
    """PEFT's tensors ``(key, spooled tensor)``, ``adapter_config.json`` and the report's
    ``adapter`` summary from a route's units."""
    base = ctx.base
    modules = module_names(base.tensors)
    tie = ties_embeddings(base)
    lora: dict[str, tuple[int, dict]] = {}
    full: dict[str, tuple[int, dict]] = {}
    tied_twins = [r for _, r in units if r.get("written_as") == "tied"]
    for idx, rec in units:
        if rec.get("written_as") == "lora":
            lora[rec["module"]] = (idx, rec)
        elif rec.get("written_as") == "full":
            full[rec["name"]] = (idx, rec)
    items: list[tuple[str, TensorInfo]] = []
    # a tied output layer's low-rank update goes on the input embedding, whose LoRA PEFT ties
    # to the output layer (ensure_weight_tying); inputs' own tying layout is kept as it is
    relocate = tie and not ctx.exact
    twin_of = {r["tied_to"]: r["name"] for r in tied_twins if r.get("tied_to")}
    tied_lora = any(
        bool(f.adapter.config_raw.get("ensure_weight_tying"))
        for f in ctx.fts
        if isinstance(f, AdapterCheckpoint)
    )
    ranks: dict[str, int] = {}
    dora = {bool(rec.get("dora")) for _, rec in lora.values()}
    if len(dora) > 1:
        raise RuntimeFailure("internal error: an adapter output with DoRA and plain LoRA modules")
    use_dora = dora == {True}
    for m, (idx, rec) in lora.items():
        t = stage.spooled(idx)
        a, b = t["A"], t["B"]
        if use_dora:
            items.append((f"{PEFT_PREFIX}{m}.lora_magnitude_vector", t["magnitude"]))
        target, embedding = m, bool(rec.get("embedding"))
        if relocate and not embedding and OUTPUT_HEAD.search(rec["name"]):
            twin = twin_of.get(rec["name"])
            if twin is None or not VOCAB_EMBEDDING.search(twin):
                raise InputError(
                    f"--format peft: {rec['name']!r} is tied to an input embedding that BASE does not "
                    "store under a known name; write a full checkpoint"
                )
            target, embedding = twin.rsplit(".", 1)[0], True
            a, b = _transposed_view(b), _transposed_view(a)
            rec["written_on"] = target
        if relocate and embedding:
            if target.rsplit(".", 1)[-1] not in PEFT_TIED_EMBEDDINGS:
                raise InputError(
                    f"--format peft: the input embedding {target!r} is tied to the output layer, but PEFT "
                    f"ties an embedding's LoRA to the output layer only for modules named "
                    f"{' or '.join(PEFT_TIED_EMBEDDINGS)}, so the loaded adapter would update the input "
                    "embedding alone; write a full checkpoint"
                )
            tied_lora = True
        ranks[target] = int(rec["rank"])
        key_a, key_b = lora_keys(target, embedding)
        items += [(key_a, a), (key_b, b)]
    modules_to_save: set[str] = set()
    lora_bias = False
    for name, (idx, _rec) in full.items():
        if "." not in name:
            raise InputError(f"--format peft: tensor {name!r} is not a module parameter PEFT can save")
        m, p = name.rsplit(".", 1)
        value = stage.spooled(idx)["value"]
        if m in ranks:
            items.append((f"{PEFT_PREFIX}{m}.base_layer.{p}", value))
            lora_bias = lora_bias or p == "bias"
        else:
            modules_to_save.add(m)
            items.append((f"{PEFT_PREFIX}{name}", value))
    if tie and any(
        VOCAB_EMBEDDING.search(f"{m}.weight") or OUTPUT_HEAD.search(f"{m}.weight") for m in modules_to_save
    ):
        raise InputError(
            "--format peft: the tied embeddings change in a way that is not low-rank, and PEFT cannot keep "
            "a whole copy of them tied (modules_to_save); write a full checkpoint"
        )
    model_type = (base.config() or {}).get("model_type")
    for m in sorted({*ranks, *modules_to_save}):
        loaded = loaded_module_name(m, model_type)
        if loaded is not None:
            raise InputError(
                f"--format peft: module {m!r} is not a module of the model transformers 5 loads (it has "
                f"{loaded} instead), and PEFT applies an adapter to the loaded model's modules; write a "
                "full checkpoint"
            )
    check_modules_to_save(sorted(modules_to_save), modules)
    for m in sorted(modules_to_save):
        for n, info in base.tensors.items():
            if n.rsplit(".", 1)[0] == m and n not in full:
                items.append((f"{PEFT_PREFIX}{n}", info))
    lora_units = [rec for _, rec in lora.values()]
    fan_in_fan_out = any(r.get("transposed") and not r.get("embedding") for r in lora_units)
    base_name, base_kind = base_reference(base)
    config = adapter_config(
        ranks=ranks,
        modules=modules,
        modules_to_save=sorted(modules_to_save),
        bias="lora_only" if lora_bias else "none",
        fan_in_fan_out=fan_in_fan_out,
        base_model=base_name,
        revision=base.revision,
        task_type=task_type(ctx.base, ctx.fts),
        tie_embeddings=bool(tied_lora),
        use_dora=use_dora,
    )
    rank_list = [int(r["rank"]) for r in lora_units]
    lost = [float(r.get("energy_lost", 0.0)) for r in lora_units]
    summary = {
        "lora_modules": len(lora_units),
        "full_tensors": len(full),
        "modules_to_save": sorted(modules_to_save),
        "r": config["r"],
        "rank_median": statistics.median(rank_list) if rank_list else None,
        "rank_max": max(rank_list) if rank_list else None,
        "rank_pattern_entries": len(config["rank_pattern"]),
        "energy_lost_max": max(lost) if lost else 0.0,
        "tied_embeddings": bool(tied_lora),
        "rank_cap": (
            f"--rank {ctx.rank}"
            if ctx.rank is not None
            else (
                "the largest input rank of each module"
                if not ctx.exact and ctx.core_rule is None and ctx.input_ranks
                else None
            )
        ),
        "route": "exact" if ctx.exact else "core-space" if ctx.core_rule is not None else "factored",
        "dora": use_dora,
        "base_model_name_or_path": base_name,
        "base_reference": base_kind,
    }
    return items, config, summary


def task_type(base: Checkpoint, fts: Sequence[Checkpoint]) -> str | None:
    """PEFT's ``task_type``: the adapter inputs' one, else what BASE's architecture says."""
    types = {f.adapter.config_raw.get("task_type") for f in fts if isinstance(f, AdapterCheckpoint)}
    types.discard(None)
    if len(types) == 1:
        return types.pop()
    archs = (base.config() or {}).get("architectures") or []
    if any(isinstance(a, str) and a.endswith("ForCausalLM") for a in archs):
        return "CAUSAL_LM"
    if any(isinstance(a, str) and a.endswith("ForConditionalGeneration") for a in archs):
        return "SEQ_2_SEQ_LM"
    return None


def _transposed_view(info: TensorInfo) -> TensorInfo:
    """A spooled 2-D factor read back transposed (the tied embedding's orientation)."""
    from dghard_cli.lora.source import ComputedTensorInfo

    rows, cols = info.shape
    return ComputedTensorInfo(
        name=info.name,
        dtype="F32",
        shape=(cols, rows),
        shard=info.shard,
        file=info.file,
        offset=0,
        nbytes=rows * cols * 4,
        reader=info.reader,
        compute=lambda r, _i=info: _slice(_i.read().T, r),
        output_dtype=info.dtype,
    )


def _slice(t: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    return (t if rows is None else t[rows[0] : rows[1]]).to(torch.float64)


def lora_factors(
    ctx: RouteContext, name: str, fac, rec: dict, model_type: str | None
) -> dict[str, torch.Tensor]:
    """A module's update ``Δ = fac.left @ fac.right`` as PEFT's ``A`` and ``B`` (transposed for
    embeddings and Conv1D layers) in the factors' dtype; its record says how (both routes)."""
    embedding = bool(VOCAB_EMBEDDING.search(name))
    transposed = embedding or (model_type in CONV1D_MODEL_TYPES and not OUTPUT_HEAD.search(name))
    a, b = (fac.left.T, fac.right.T) if transposed else (fac.right, fac.left)
    dt = torch_dtype(ctx.factor_dtype)
    rec.update(
        {
            "written_as": "lora",
            "embedding": embedding,
            "transposed": transposed,
            "rank": fac.rank,
            "lora": fac.stats(),
            "energy_lost": fac.energy_lost,
            # exact: every numerically resolved direction of Δ* is kept
            "exact": fac.rank >= fac.numerical_rank,
            "update_energy": fac.fro2,
        }
    )
    return {"A": a.contiguous().to(dt), "B": b.contiguous().to(dt)}
