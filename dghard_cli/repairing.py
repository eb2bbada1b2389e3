"""``dghard repair``: DG-Hard (or another spectral shrinker) on every weight delta.

W* = W_base + Δ*,   Δ* = the singular components of Δ = W_ft − W_base that survive the
                          Gavish–Donoho cut (or another shrinker's weights).

With a layer-strength schedule (``schedule``, see :mod:`dghard_cli.schedule`):
W = W_base + λ(ℓ)·Δ* — or W_base + λ(ℓ)·Δ when ``spec`` is None (no spectral filter).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from dghard_cli.engine.plan import PolicyOptions, build_plan
from dghard_cli.engine.writer import RunOptions, WriteRequest
from dghard_cli.errors import InputError
from dghard_cli.io.hub import open_checkpoint
from dghard_cli.io.safetensors_format import dtype_flag
from dghard_cli.lora.output import AdapterOutput, LoraOutputOptions
from dghard_cli.lora.source import open_ft
from dghard_cli.methods.dg_hard import SpectralFilterOp, default_block_bytes
from dghard_cli.numbers import flag_value
from dghard_cli.schedule.bind import bind as bind_schedule
from dghard_cli.schedule.bind import scheduled_eligibility
from dghard_cli.schedule.op import wrap as wrap_scheduled
from dghard_cli.schedule.spec import LayerSchedule
from dghard_cli.spectral.spectrum import ShrinkSpec


@dataclass
class RepairOptions:
    spec: ShrinkSpec | None = field(default_factory=ShrinkSpec)  # None: no filter (a schedule alone)
    policy: PolicyOptions = field(default_factory=PolicyOptions)
    run: RunOptions = field(default_factory=RunOptions)
    base_revision: str | None = None
    ft_revision: str | None = None
    block_bytes: int | None = None  # float64 block size of the spectral passes; None: by device
    route: str = "auto"  # auto | gram64 | qr32 (see spectral.choose_route)
    schedule: LayerSchedule | None = None  # --lines / --layer-strengths
    lora: LoraOutputOptions = field(default_factory=LoraOutputOptions)  # --format/--merge/--rank


def repair_argv(base: str, ft: str, out: str, opts: RepairOptions) -> list[str]:
    """The ``dghard repair`` command line that runs ``repair(base, ft, out, opts)``: the filter,
    the schedule, ``--dtype``, ``--merge`` and ``--device`` (what a sweep candidate sets; the
    other options at their defaults). Parsing it gives ``opts`` back (tests/test_sweep_families.py)."""
    argv = ["dghard", "repair", base, ft, out]
    if opts.schedule is not None:
        argv += opts.schedule.argv()
    spec = opts.spec
    if spec is not None:
        argv += ["--shrink", spec.shrink, "--scale", flag_value(spec.scale)]
        if spec.shrink == "twoknob":
            argv += ["--a", flag_value(spec.a), "--b", flag_value(spec.b)]
        if spec.noise != "median":
            argv += ["--noise", spec.noise] + (
                ["--sigma", flag_value(spec.sigma)] if spec.sigma is not None else []
            )
    return argv + output_flags(opts.policy, opts.lora, opts.run)


def output_flags(policy: PolicyOptions, lora: LoraOutputOptions, run: RunOptions) -> list[str]:
    """``--dtype``, ``--merge`` and ``--device`` as given (the tail of a reproduction command)."""
    argv = ["--dtype", dtype_flag(policy.out_dtype)] if policy.out_dtype is not None else []
    argv += ["--merge"] if lora.merge else []
    return argv + (["--device", run.device] if run.device != "auto" else [])


def repair_parameters(opts: RepairOptions) -> dict:
    p = opts.spec.describe() if opts.spec is not None else {}
    pol = opts.policy
    p.update(
        {
            "min_numel": pol.min_numel,
            "include": list(pol.include),
            "exclude": list(pol.exclude),
            "allow_missing": pol.allow_missing,
            "dtype": pol.out_dtype,
            "shard_size": pol.shard_size,
        }
    )
    if opts.spec is not None:
        p["route"] = opts.route
    if opts.schedule is not None:
        p.update(opts.schedule.describe())
    return p


def repair(base: str | Path, ft: str | Path, out: str | Path, options: RepairOptions | None = None) -> dict:
    """Repair FT against BASE into OUT; returns the report (also written to OUT).

    With ``options.run.dry_run`` nothing is written and the report holds the plan.

    Example::

        from dghard_cli import RepairOptions, ShrinkSpec, repair
        doc = repair("base/", "ft/", "out/", RepairOptions(spec=ShrinkSpec(scale=1.0)))
        print(doc["summary"]["verdict"])
    """
    opts = options or RepairOptions()
    if opts.spec is None and opts.schedule is None:
        raise InputError("nothing to do: no spectral filter and no layer-strength schedule")
    t0 = time.perf_counter()
    base_ck = open_checkpoint(str(base), revision=opts.base_revision, label="BASE")
    try:
        ft_ck = open_ft(str(ft), base=base_ck, revision=opts.ft_revision, label="FT")
    except BaseException:
        base_ck.close()
        raise
    try:
        spec = opts.spec
        if spec is None:
            method = "lines" if opts.schedule.form == "lines" else "layer-strengths"  # type: ignore[union-attr]
        else:
            method = "dg-hard" if spec.shrink == "hard" else f"spectral-{spec.shrink}"
        output = AdapterOutput(
            opts.lora,
            base_ck,
            [ft_ck],
            command="repair",
            method=method,
            params={},
            spec=spec,
            out_dtype=opts.policy.out_dtype,
        )
        eligible = scheduled_eligibility(opts.policy) if spec is None else None
        plan = build_plan(base_ck, [ft_ck], opts.policy, eligible=eligible)
        strengths = bind_schedule(opts.schedule, plan, ft_ck) if opts.schedule is not None else None
        timings = {"plan": time.perf_counter() - t0}

        def make_op(device):
            if spec is None:
                return None
            return SpectralFilterOp(spec, device, opts.block_bytes or default_block_bytes(device), opts.route)

        run_op = wrap_scheduled(make_op) if strengths is not None else make_op
        request = WriteRequest(
            command="repair",
            method=method,
            parameters=repair_parameters(opts),
            base=base_ck,
            fts=[ft_ck],
            out=Path(out),
            plan=plan,
            make_op=run_op,
            run=opts.run,
            spectral=spec is not None,
            extra_report=(lambda records: {"layer_strengths": strengths.report()})
            if strengths is not None
            else None,
            timings=timings,
            strengths=strengths,
        )
        return output.write(request)
    finally:
        base_ck.close()
        ft_ck.close()
