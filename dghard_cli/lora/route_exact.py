"""The exact route of an adapter output: a method linear in the task vectors on plain LoRA inputs.

Per module ``B = [c_1 s_1 B_1, c_2 s_2 B_2, …]`` and ``A = [A_1; A_2; …]`` (rank Σ r_i, as PEFT's
``add_weighted_adapter(combination_type="cat")``), ``c_i(tensor)`` from
:func:`dghard_cli.lora.output.linear_coefficients` (times λ(ℓ) under a layer-strength
schedule); full tensors combined elementwise in float64. No base weight is read for the factors;
``--rank R`` truncates the concatenation exactly (SVD of the factors).

:func:`exact_units` is given everything it reads: the run's
:class:`~dghard_cli.lora.context.RouteContext` (inputs, coefficients, λ per tensor, ``--rank``,
dtypes) and the staging directory it spools each unit into.

**DoRA.** When an input is a DoRA adapter the output is one too (``use_dora`` applies to every
module of a PEFT config): each module is combined by :func:`dghard_cli.lora.dora.combine`, which
scales each row of each B and recomputes the magnitude vector from the base weight (read once
per module, in row blocks), so the layer equals ``W + Σ c_k (W_k − W)`` exactly.
:func:`dora_blocker` says when that cannot be done (an embedding or Conv1D module, a replaced
base weight, ``lora_bias``); the run then takes the factored route.
"""

from __future__ import annotations

import torch

from dghard_cli.errors import InputError
from dghard_cli.io.checkpoint import TensorInfo
from dghard_cli.io.safetensors_format import torch_dtype
from dghard_cli.lora.context import RouteContext
from dghard_cli.lora.dora import DoraCancelled, DoraPart, combine
from dghard_cli.lora.source import AdapterCheckpoint
from dghard_cli.lora.writer import AdapterStage
from dghard_cli.spectral.lowrank import factorize_product


def uses_dora(fts) -> bool:
    """Is any input a DoRA adapter (so that the exact route writes DoRA)?"""
    return any(isinstance(f, AdapterCheckpoint) and f.cfg.use_dora for f in fts)


def dora_blocker(fts) -> str | None:
    """Why these adapters' strengths cannot be written as one DoRA adapter (None: they can).

    PEFT's ``use_dora`` applies to every module of the config, so every module must be a Linear
    DoRA layer: no embedding or Conv1D module, no replaced base weight (``base_layer.weight``),
    no ``lora_bias`` in a DoRA input."""
    for f in fts:
        if not isinstance(f, AdapterCheckpoint):
            return f"FT {f.source} is not an adapter"
        for m, d in f.modules.items():
            if d.embedding or d.transposed:
                kind = "an embedding" if d.embedding else "a Conv1D layer"
                return f"module {m!r} of {f.source} is {kind}, and PEFT's DoRA applies to every module"
            if d.weight_name in f.full:
                return f"{f.source} replaces the base weight of {m!r} (base_layer.weight)"
            if d.magnitude is not None and d.b_bias is not None:
                return f"module {m!r} of {f.source} has lora_bias"
    return None


def exact_units(ctx: RouteContext, stage: AdapterStage) -> list[tuple[int, dict]]:
    """Every module's concatenated factors, then every full tensor combined elementwise, each
    spooled into ``stage`` (a unit an interrupted run spooled already is taken as it is); returns
    ``(index, record)`` per unit."""
    base = ctx.base
    fts: list[AdapterCheckpoint] = list(ctx.fts)  # type: ignore[arg-type]
    coeffs = ctx.coefficients
    assert coeffs is not None
    order = {n: i for i, n in enumerate(base.tensors)}
    module_set = {m for f in fts for m in f.modules}
    modules = sorted(module_set, key=lambda m: order.get(f"{m}.weight", len(order)))
    full_names = set()
    for f in fts:
        full_names |= set(f.full)
        full_names |= {f"{d.module}.bias" for d in f.modules.values() if d.b_bias is not None}
    dora = uses_dora(fts)
    units: list[tuple[int, dict]] = []
    index = 0
    for m in modules:
        weight = f"{m}.weight"
        done = stage.resumed(index)
        if done is not None:
            units.append((index, done))
            index += 1
            continue
        c = coeffs(weight)
        parts = []
        kinds = set()
        for i, f in enumerate(fts):
            d = f.modules.get(m)
            if d is None or c[i] == 0:
                continue
            b, a = d.factors()
            parts.append((b * (c[i] * d.scaling), a, d))
            kinds.add((d.embedding, d.transposed))
        rec = {"name": weight, "module": m, "action": "method", **_strength_fields(ctx, weight)}
        if len(kinds) > 1:
            raise InputError(
                f"module {m!r} is an embedding or Conv1D layer in one adapter and not in another; "
                "these adapters are not for the same base"
            )
        if not parts:
            rec["written_as"] = "unchanged"
            units.append((index, rec))
            stage.put(index, {}, rec)
            index += 1
            continue
        embedding, transposed = kinds.pop()
        if dora:
            rec, tensors = _dora_unit(ctx, m, list(zip(_used(c, fts, m), parts, strict=True)), rec)
            rec["coefficients"] = [float(x) for x in c]
            stage.put(index, tensors, rec)
            units.append((index, rec))
            index += 1
            continue
        b = torch.cat([p[0] for p in parts], dim=1)
        a = torch.cat([p[1] for p in parts], dim=0)
        ranks_in = [p[0].shape[1] for p in parts]
        lost, cut, energy = 0.0, False, _product_energy(b, a)
        if ctx.rank is not None and b.shape[1] > ctx.rank:
            fac = factorize_product(b, a, ctx.rank)
            cut = fac.rank < fac.numerical_rank
            b, a, lost, energy = fac.left, fac.right, fac.energy_lost, fac.fro2
        rec.update(
            {
                "written_as": "lora" if b.shape[1] else "unchanged",
                "embedding": embedding,
                "transposed": transposed,
                "rank": int(b.shape[1]),
                "ranks_in": ranks_in,
                "coefficients": [float(x) for x in c],
                "energy_lost": lost,
                "exact": not cut,
                "update_energy": energy,
            }
        )
        dt = torch_dtype(ctx.factor_dtype)
        tensors = {"A": a.to(dt), "B": b.to(dt)} if b.shape[1] else {}
        stage.put(index, tensors, rec)
        units.append((index, rec))
        index += 1
    for name in sorted(full_names, key=lambda n: order.get(n, len(order))):
        done = stage.resumed(index)
        if done is not None:
            units.append((index, done))
            index += 1
            continue
        binfo = base.tensors[name]
        c = coeffs(name)
        w0 = binfo.read().to(torch.float64)
        w = w0.clone()
        for i, f in enumerate(fts):
            module = name.rsplit(".", 1)[0]
            src = f.full.get(name) if (name.endswith(".weight") and module in f.modules) else f.tensors[name]
            if src is None or src is binfo or c[i] == 0:
                continue
            if tuple(src.shape) != tuple(binfo.shape):
                raise InputError(
                    f"--format peft: adapter {f.source} resizes {name!r} ({list(binfo.shape)} -> "
                    f"{list(src.shape)}); an adapter output cannot change BASE's shapes — add --merge"
                )
            w.add_(src.read().to(torch.float64).sub_(w0), alpha=c[i])
        rec = {
            "name": name,
            "module": name.rsplit(".", 1)[0],
            "action": "method",
            "shape": list(binfo.shape),
            **_strength_fields(ctx, name),
        }
        if bool(torch.equal(w, w0)):
            rec["written_as"] = "unchanged"
            stage.put(index, {}, rec)
        else:
            rec["written_as"] = "full"
            rec["delta_norm"] = float(torch.linalg.vector_norm(w - w0))
            stage.put(index, {"value": w.to(torch_dtype(_full_dtype(ctx, binfo)))}, rec)
        units.append((index, rec))
        index += 1
    return units


def _used(c: list[float], fts, module: str) -> list[float]:
    """The coefficients of the inputs that hold ``module`` with a non-zero coefficient, in order."""
    return [c[i] for i, f in enumerate(fts) if module in f.modules and c[i] != 0]


def _product_energy(b: torch.Tensor, a: torch.Tensor) -> float:
    """‖B·A‖_F² without forming the product: Σ (BᵀB) ⊙ (A Aᵀ)."""
    b64, a64 = b.to(torch.float64), a.to(torch.float64)
    return float(torch.sum((b64.T @ b64) * (a64 @ a64.T)))


def _dora_unit(ctx: RouteContext, module: str, parts: list, rec: dict) -> tuple[dict, dict]:
    """One module of a DoRA output: :func:`dghard_cli.lora.dora.combine` of its inputs."""
    deltas = [d for _, (_, _, d) in parts]
    w = deltas[0].base
    shape = (int(w.shape[0]), int(w.shape[1]))
    dparts = []
    for ci, (_, _, d) in parts:  # the parts' B carry c already; DoraPart takes s·B and c apart
        b, a = d.factors()
        mag = d.magnitude.read().to(torch.float64).reshape(-1) if d.magnitude is not None else None
        dparts.append(DoraPart(c=ci, sb=b * d.scaling, a=a, magnitude=mag))
    try:
        res = combine(w.read, shape, dparts, ctx.rank)
    except DoraCancelled as exc:
        raise InputError(
            f"--format peft: module {module!r}: the strengths cancel row {exc.row} of the base weight "
            "(1 + Σ c·(m/‖W + ΔW‖ − 1) = 0), which a DoRA layer cannot hold; add --merge to write the "
            "exact merged model"
        ) from None
    rec.update(
        {
            "written_as": "lora",
            "embedding": False,
            "transposed": False,
            "dora": True,
            "rank": int(res.b.shape[1]),
            "ranks_in": [int(sb.shape[1]) for _, (sb, _, _) in parts],
            "energy_lost": res.energy_lost,
            "exact": not res.cut,
            "update_energy": res.update_energy,
        }
    )
    dt = torch_dtype(ctx.factor_dtype)
    return rec, {"A": res.a.to(dt), "B": res.b.to(dt), "magnitude": res.magnitude.to(dt)}


def _strength_fields(ctx: RouteContext, name: str) -> dict:
    """The report's per-tensor ``layer``/``layer_strength`` under a schedule (as in a full run)."""
    if name not in ctx.layer_strengths:
        return {}
    layer, lam = ctx.layer_strengths[name]
    return {"layer": layer, "layer_strength": lam}


def _full_dtype(ctx: RouteContext, info: TensorInfo) -> str:
    return ctx.out_dtype or getattr(info, "output_dtype", None) or info.dtype
