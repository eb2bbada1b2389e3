"""A candidate of any family of ``dghard sweep`` made from its entry at an axis value
(:func:`make_candidate`), its reproduction command line (:func:`reproduce_argv`) and written
(:func:`write_candidate`): the one-axis families here, the two-dimensional ``lines`` family by
:mod:`dghard_cli.sweeping.lines`. What a family, an entry and a candidate are is in
:mod:`dghard_cli.sweeping.candidates`.

Every candidate is written by the library function of its command (``repair`` or ``merge``),
so it is byte for byte what the printed command writes. With LoRA adapters as fine-tunes,
:func:`writes_adapter` decides the format per candidate: an adapter where the candidate is exact
in adapter form, else the full merged checkpoint (``--merge``); the command line says which.
"""

from __future__ import annotations

from pathlib import Path

from dghard_cli.engine.plan import PolicyOptions
from dghard_cli.engine.writer import RunOptions
from dghard_cli.errors import InputError
from dghard_cli.io.checkpoint import Checkpoint
from dghard_cli.io.safetensors_format import dtype_flag
from dghard_cli.lora.output import LoraOutputOptions, linear_coefficients
from dghard_cli.lora.route_exact import dora_blocker, uses_dora
from dghard_cli.lora.source import is_adapter
from dghard_cli.merging import MergeOptions, merge, resolve_parameters
from dghard_cli.methods import registry
from dghard_cli.methods.declare import LINES
from dghard_cli.repairing import RepairOptions, repair
from dghard_cli.spectral.spectrum import ShrinkSpec
from dghard_cli.sweeping import lines
from dghard_cli.sweeping.candidates import Candidate, FamilyEntry, _fmt, is_number


def make_candidate(entry: FamilyEntry, value: float, *, n_fts: int, where: str = "candidate") -> Candidate:
    """The candidate of ``entry`` at axis value ``value``: every parameter explicit and checked."""
    if entry.family == "lines":  # value: an (α, β) pair or a per-group point
        return lines.make_candidate(entry, value, n_fts=n_fts, where=where)  # type: ignore[arg-type]
    try:
        return _make_candidate(entry, value, n_fts)
    except InputError as exc:
        raise InputError(f"{where}: {exc}") from None


def _make_candidate(entry: FamilyEntry, value: float, n_fts: int) -> Candidate:
    kind = entry.kind
    axis = entry.axis or kind.axes[0]
    value = float(value)
    vals = {**entry.fixed, axis: value}
    if kind.command == "repair":
        shrink = entry.family
        spec = ShrinkSpec(
            shrink=shrink,
            scale=float(vals.get("scale", 1.0)),
            noise=str(vals.get("noise", "known" if "sigma" in vals else "median")),
            sigma=None if vals.get("sigma") is None else float(vals["sigma"]),
            a=float(vals.get("a", 1.0)),
            b=float(vals.get("b", 0.0)),
        )
        p = {"shrink": spec.shrink, "scale": spec.scale, "noise": spec.noise}
        if spec.noise == "known":
            p["sigma"] = spec.sigma
        if shrink == "twoknob":
            p["a"], p["b"] = spec.a, spec.b
    else:
        weights = vals.get("weights")
        if weights is not None and (not isinstance(weights, list) or not all(is_number(w) for w in weights)):
            raise InputError("'weights' must be a list of numbers")
        given = {q.name: vals.get(q.name) for q in registry.carried_params()}
        given["weights"] = None if weights is None else [float(w) for w in weights]
        kwargs, extra = registry.options_values(given)
        p = resolve_parameters(MergeOptions(method=entry.family, extra=extra, **kwargs), n_fts)
        carried = {"method", *(q.name for q in registry.carried_params())}
        p = {k: v for k, v in p.items() if k in carried}
    params = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in p.items()))
    return Candidate(
        entry=entry.index, family=entry.family, command=kind.command, axis=axis, value=value, params=params
    )


def writes_adapter(cand: Candidate, fts: list[Checkpoint]) -> bool:
    """Whether ``cand`` is written as a PEFT adapter (its command without ``--merge``).

    Yes when every fine-tune is a LoRA adapter and the candidate is linear in their updates —
    WiSE-FT, task arithmetic, a layer-strength schedule alone, or a linear merge under one: the
    exact route of :mod:`dghard_cli.lora.output` writes it without approximation (B scaled, A
    kept; DoRA stays DoRA where :func:`~dghard_cli.lora.route_exact.dora_blocker` allows, the
    condition ``AdapterOutput.exact`` uses). Any other candidate of adapters (a spectral cut at a
    known σ, TIES, DARE, DG-Hard, DoRA that cannot stay DoRA) would be factored at a rank, so it is
    written as the full merged checkpoint. Full fine-tunes: never.
    """
    if not fts or not all(is_adapter(f) for f in fts):
        return False
    if uses_dora(fts) and dora_blocker(fts) is not None:
        return False
    p = cand.param_dict
    if cand.command == "repair":
        return cand.family == "lines" and "shrink" not in p
    if "calibrate" in p:  # SVC re-weights the merged update's singular values: not linear
        return False
    return linear_coefficients(str(p["method"]), p) is not None


def reproduce_argv(
    cand: Candidate,
    base: str,
    fts: list[str],
    out: str,
    device: str,
    *,
    merge_adapters: bool = False,
    dtype: str | None = None,
) -> list[str]:
    """The one ``dghard repair``/``dghard merge`` command line that writes this candidate
    (``merge_adapters``: written as the full merged checkpoint of LoRA fine-tunes, ``--merge``;
    ``dtype``: the output dtype, ``--dtype``)."""
    tail = (["--dtype", dtype_flag(dtype)] if dtype is not None else []) + (
        ["--merge"] if merge_adapters else []
    )
    if cand.family == "lines":
        return lines.reproduce_argv(cand, base, fts[0], out, device) + tail
    p = cand.param_dict
    dev = tail + (["--device", device] if device != "auto" else [])
    if cand.command == "repair":
        argv = ["dghard", "repair", base, fts[0], out, "--shrink", p["shrink"], "--scale", _fmt(p["scale"])]
        if p["shrink"] == "twoknob":
            argv += ["--a", _fmt(p["a"]), "--b", _fmt(p["b"])]
        if p["noise"] == "known":
            argv += ["--noise", "known", "--sigma", _fmt(p["sigma"])]
        return argv + dev
    argv = ["dghard", "merge", "--method", p["method"]]
    for q in registry.carried_params():
        if q.name in p:
            argv += [q.cli_flag, _fmt(p[q.name]) if q.scalar else str(p[q.name])]
    if "lines" in p:  # a merge under a LiNeS schedule (sweep/merges.py follow-up)
        argv += [LINES.cli_flag, f"{_fmt(p['lines'][0])},{_fmt(p['lines'][1])}"]
    return argv + [base, *fts, "--out", out] + dev


def write_candidate(
    cand: Candidate,
    base: str,
    fts: list[str],
    out: Path,
    *,
    device: str,
    argv: list[str],
    report_out: str | None = None,
    merge_adapters: bool = False,
    dtype: str | None = None,
) -> dict:
    """Write ``cand`` into ``out`` with the command's own library function; returns its report.

    ``report_out``: the output path its report names (the sweep's OUT, where the winner is
    moved); None: ``out``. ``dtype``: the output dtype of floating tensors (a safetensors name);
    None: the command's default.
    """
    if cand.family == "lines":
        return lines.write_candidate(
            cand,
            base,
            fts[0],
            out,
            device=device,
            argv=argv,
            report_out=report_out,
            merge_adapters=merge_adapters,
            dtype=dtype,
        )
    p = cand.param_dict
    run = RunOptions(device=device, quiet=True, argv=argv, report_out=report_out)
    lora = LoraOutputOptions(merge=merge_adapters)
    policy = PolicyOptions(out_dtype=dtype)
    if cand.command == "repair":
        spec = ShrinkSpec(
            shrink=p["shrink"],
            scale=p["scale"],
            noise=p["noise"],
            sigma=p.get("sigma"),
            a=p.get("a", 1.0),
            b=p.get("b", 0.0),
        )
        return repair(base, fts[0], out, RepairOptions(spec=spec, policy=policy, run=run, lora=lora))
    kwargs, extra = registry.options_values({q.name: p.get(q.name) for q in registry.carried_params()})
    if "lines" in p:  # the schedule as --lines builds it
        kwargs[LINES.attr] = LINES.build([float(p["lines"][0]), float(p["lines"][1])])
    return merge(
        base,
        fts,
        out,
        MergeOptions(method=p["method"], extra=extra, policy=policy, run=run, lora=lora, **kwargs),
    )
