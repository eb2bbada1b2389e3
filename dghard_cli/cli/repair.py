"""``dghard repair``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from dghard_cli.cli.common import (
    AllowLossyOpt,
    BaseArg,
    BaseRevisionOpt,
    DeviceOpt,
    DryRunOpt,
    DtypeOpt,
    ExcludeOpt,
    FormatOpt,
    FtArg,
    IncludeOpt,
    JsonOpt,
    MergeOpt,
    OverwriteOpt,
    QuietOpt,
    RankOpt,
    ReportOpt,
    ResumeOpt,
    RevisionOpt,
    ShardSizeOpt,
    VerboseOpt,
    app,
    choices,
    emit,
    lora_options,
    run_cli,
)
from dghard_cli.methods.declare import LAYER_STRENGTHS, LINES
from dghard_cli.spectral.spectrum import NOISE_RULES, ROUTES, SHRINKERS

#: The layer-strength options, as merge has them (declared once: methods/declare.py COMMON).
LinesOpt = Annotated[Optional[str], typer.Option(LINES.cli_flag, help=LINES.help, show_default=False)]
LayerStrengthsOpt = Annotated[
    Optional[str], typer.Option(LAYER_STRENGTHS.cli_flag, help=LAYER_STRENGTHS.help, show_default=False)
]

REPAIR_EPILOG = """
**Examples**

    dghard repair examples/tiny/base examples/tiny/ft /tmp/repaired

    dghard repair Qwen/Qwen2.5-0.5B ./my-finetune ./repaired --device cuda --report repaired/report.json

    dghard repair BASE FT OUT --dry-run          # plan only, reads headers

    dghard repair BASE FT OUT --shrink twoknob --a 1 --b 0.3 --exclude 'lm_head|embed'

    dghard repair BASE FT OUT --lines 0.2,0.6                   # W_base + λ(ℓ)·Δ (LiNeS)

    dghard repair BASE FT OUT --lines 0.2,0.6 --shrink hard     # W_base + λ(ℓ)·Δ* (DG-Hard, then λ)
    dghard repair BASE FT OUT --format peft        # the repair as a PEFT LoRA adapter (rank = kept rank)

    dghard repair BASE ADAPTER OUT --merge         # FT a LoRA adapter: repair the merged checkpoint

**On real fine-tunes** the cut finds no noise bulk in most deltas and keeps nearly all of the update
(the verdict says so): the output is then close to the fine-tune. A plain strength repairs more
(`--lines 0.2,0.6`, or `dghard merge --method wise-ft --alpha 0.4`); `dghard sweep` chooses one
with your own evaluation (docs/repair.md).
"""


@app.command("repair", epilog=REPAIR_EPILOG)
def repair_cmd(
    base: BaseArg,
    ft: FtArg,
    out: Annotated[
        Path, typer.Argument(help="Output directory (must not exist, or be empty, or --overwrite).")
    ],
    scale: Annotated[
        Optional[float], typer.Option(help="Multiplies the threshold τ (default 1.0 = Gavish–Donoho).")
    ] = None,
    noise: Annotated[
        Optional[str],
        typer.Option(
            metavar=choices(NOISE_RULES),
            help="median (unknown noise, from the median singular value; default) or known (--sigma).",
        ),
    ] = None,
    sigma: Annotated[
        Optional[float], typer.Option(help="Known per-entry noise std (with --noise known).")
    ] = None,
    shrink: Annotated[
        Optional[str],
        typer.Option(
            metavar=choices(SHRINKERS),
            help="hard (the paper; default), soft (σ − τ), optimal (Gavish–Donoho 2017 Frobenius), twoknob (a·spikes + b·bulk). With --lines: filter first, then scale (without a shrinker option --lines scales Δ itself).",
        ),
    ] = None,
    a: Annotated[
        Optional[float], typer.Option("--a", help="twoknob: weight of the spikes (σ > τ; default 1).")
    ] = None,
    b: Annotated[
        Optional[float], typer.Option("--b", help="twoknob: weight of the bulk (default 0).")
    ] = None,
    lines: LinesOpt = None,
    layer_strengths: LayerStrengthsOpt = None,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    min_numel: Annotated[int, typer.Option(help="Smaller matrices keep the fine-tune's value.")] = 1024,
    shard_size: ShardSizeOpt = None,
    dtype: DtypeOpt = None,
    report: ReportOpt = None,
    dry_run: DryRunOpt = False,
    resume: ResumeOpt = False,
    overwrite: OverwriteOpt = False,
    allow_nonfinite: Annotated[
        bool,
        typer.Option(
            "--allow-nonfinite",
            help="Tensors holding NaN/Inf keep the fine-tune's value (reported) instead of being an error.",
        ),
    ] = False,
    allow_missing: Annotated[
        bool,
        typer.Option(
            "--allow-missing", help="Tensors only in BASE keep their base values instead of being an error."
        ),
    ] = False,
    revision: RevisionOpt = None,
    base_revision: BaseRevisionOpt = None,
    route: Annotated[
        str,
        typer.Option(
            metavar=choices(ROUTES),
            help="Linear algebra: gram64 (float64 Gram, exact), qr32 (float32 QR + float64 eigh, for GPUs with slow float64; ambiguous cuts are redone in float64), auto.",
        ),
    ] = "auto",
    output_format: FormatOpt = "auto",
    merge: MergeOpt = False,
    rank: RankOpt = None,
    allow_lossy: AllowLossyOpt = False,
    device: DeviceOpt = "auto",
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Repair FT against BASE: keep the spectral spikes of every weight delta, drop the noise bulk."""

    def body() -> None:
        from dghard_cli.io.out_path import precheck_out

        precheck_out(out, overwrite=overwrite)  # before seconds of imports
        from dghard_cli.cli.render import is_adapter_doc, render_adapter, render_plan, render_report
        from dghard_cli.engine.plan import PolicyOptions, parse_size
        from dghard_cli.engine.writer import RunOptions
        from dghard_cli.io.safetensors_format import parse_dtype_option
        from dghard_cli.repairing import RepairOptions, repair
        from dghard_cli.schedule.spec import schedule_from_options
        from dghard_cli.spectral.spectrum import ShrinkSpec

        schedule = schedule_from_options(lines, layer_strengths)
        filtered = schedule is None or any(v is not None for v in (shrink, scale, noise, sigma, a, b))
        spec = ShrinkSpec(
            shrink=shrink or "hard",
            scale=1.0 if scale is None else scale,
            noise=noise or "median",
            sigma=sigma,
            a=1.0 if a is None else a,
            b=0.0 if b is None else b,
        )
        opts = RepairOptions(
            spec=spec if filtered else None,
            schedule=schedule,
            policy=PolicyOptions(
                min_numel=min_numel,
                include=include or [],
                exclude=exclude or [],
                allow_missing=allow_missing,
                out_dtype=parse_dtype_option(dtype) if dtype else None,
                shard_size=parse_size(shard_size) if shard_size else None,
            ),
            run=RunOptions(
                device=device,
                dry_run=dry_run,
                resume=True if resume else None,
                overwrite=overwrite,
                report_path=report,
                quiet=quiet or json_out,
                notices=not quiet,
                argv=["dghard", *sys.argv[1:]],
                allow_nonfinite=allow_nonfinite,
            ),
            base_revision=base_revision,
            ft_revision=revision,
            route=route,
            lora=lora_options(output_format, merge, rank, allow_lossy),
        )
        doc = repair(base, ft, out, opts)
        if is_adapter_doc(doc):
            emit(doc, as_json=json_out, quiet=quiet, render=lambda c: render_adapter(c, doc))
        elif dry_run:
            emit(doc, as_json=json_out, quiet=quiet, render=lambda c: render_plan(c, doc, verbose))
        else:
            emit(doc, as_json=json_out, quiet=quiet, render=lambda c: render_report(c, doc))

    run_cli(body, verbose=verbose)
