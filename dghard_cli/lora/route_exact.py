"""The exact route of an adapter output: a method linear in the task vectors on plain LoRA inputs.

Per module ``B = [c_1 s_1 B_1, c_2 s_2 B_2, …]`` and ``A = [A_1; A_2; …]`` (rank Σ r_i, as PEFT's
``add_weighted_adapter(combination_type="cat")``), ``c_i(tensor)`` from
:func:`dghard_cli.lora.output.linear_coefficients` (times λ(ℓ) under a layer-strength
schedule); full tensors combined elementwise in float64. No base weight is read for the factors;
``--rank R`` truncates the concatenation exactly (SVD of the factors).

:func:`exact_units` is given everything it reads: the run's
:class:`~dghard_cli.lora.context.RouteContext` (inputs, coefficients, λ per tensor, ``--rank``,
dtypes) and the staging directory it spools each unit into.
"""

from __future__ import annotations

import torch

from dghard_cli.errors import InputError
from dghard_cli.io.checkpoint import TensorInfo
from dghard_cli.io.safetensors_format import torch_dtype
from dghard_cli.lora.context import RouteContext
from dghard_cli.lora.source import AdapterCheckpoint
from dghard_cli.lora.writer import AdapterStage
from dghard_cli.spectral.lowrank import factorize_product


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
            parts.append((b * (c[i] * d.scaling), a))
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
        b = torch.cat([p[0] for p in parts], dim=1)
        a = torch.cat([p[1] for p in parts], dim=0)
        ranks_in = [p[0].shape[1] for p in parts]
        lost = 0.0
        if ctx.rank is not None and b.shape[1] > ctx.rank:
            fac = factorize_product(b, a, ctx.rank)
            b, a, lost = fac.left, fac.right, fac.energy_lost
        rec.update(
            {
                "written_as": "lora" if b.shape[1] else "unchanged",
                "embedding": embedding,
                "transposed": transposed,
                "rank": int(b.shape[1]),
                "ranks_in": ranks_in,
                "coefficients": [float(x) for x in c],
                "energy_lost": lost,
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


def _strength_fields(ctx: RouteContext, name: str) -> dict:
    """The report's per-tensor ``layer``/``layer_strength`` under a schedule (as in a full run)."""
    if name not in ctx.layer_strengths:
        return {}
    layer, lam = ctx.layer_strengths[name]
    return {"layer": layer, "layer_strength": lam}


def _full_dtype(ctx: RouteContext, info: TensorInfo) -> str:
    return ctx.out_dtype or getattr(info, "output_dtype", None) or info.dtype
