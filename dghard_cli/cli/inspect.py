"""``dghard inspect``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from dghard_cli.cli.common import (
    BaseArg,
    BaseRevisionOpt,
    DeviceOpt,
    ExcludeOpt,
    FtArg,
    IncludeOpt,
    JsonOpt,
    QuietOpt,
    RevisionOpt,
    VerboseOpt,
    app,
    emit,
    run_cli,
)

INSPECT_EPILOG = """
**Examples**

    dghard inspect examples/tiny/base examples/tiny/ft

    dghard inspect BASE FT --plot plots/ --html inspect.html          # needs dghard[plot]

    dghard inspect BASE FT --include 'mlp' --matrices 'layers\\.0\\.' --json > spectra.json

    dghard inspect BASE FT --matrices 8 --plot plots/     # spectra of the 8 largest updates
"""


@app.command("inspect", epilog=INSPECT_EPILOG)
def inspect_cmd(
    base: BaseArg,
    ft: FtArg,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    min_numel: Annotated[int, typer.Option(help="Smaller matrices are not analysed (as in repair).")] = 1024,
    scale: Annotated[float, typer.Option(help="Multiplies the threshold τ (1.0 = Gavish–Donoho).")] = 1.0,
    matrices: Annotated[
        Optional[str],
        typer.Option(
            help="Matrices whose full spectrum is kept and plotted: a regex, or N = the N largest updates (default 4 with --plot/--html)."
        ),
    ] = None,
    plot: Annotated[
        Optional[Path], typer.Option("--plot", help="Write PNG spectra and heat maps to this directory.")
    ] = None,
    html: Annotated[
        Optional[Path], typer.Option("--html", help="Write one self-contained HTML page to this file.")
    ] = None,
    revision: RevisionOpt = None,
    base_revision: BaseRevisionOpt = None,
    device: DeviceOpt = "auto",
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Spectrum of every weight delta FT − BASE (MP fit, τ, spikes, energy kept), no model written."""

    def body() -> dict:
        from dghard_cli.engine.plan import PolicyOptions
        from dghard_cli.inspection import InspectOptions, inspect_pair, parse_matrices
        from dghard_cli.spectral.spectrum import ShrinkSpec

        opts = InspectOptions(
            spec=ShrinkSpec(scale=scale),
            policy=PolicyOptions(min_numel=min_numel, include=include or [], exclude=exclude or []),
            device=device,
            matrices=parse_matrices(matrices),
            plot_dir=plot,
            html=html,
            base_revision=base_revision,
            ft_revision=revision,
            quiet=quiet or json_out,
            argv=["dghard", *sys.argv[1:]],
        )
        return inspect_pair(base, ft, opts)

    doc = run_cli(body, verbose=verbose)
    from dghard_cli.cli.render import render_inspect

    emit(doc, as_json=json_out, quiet=quiet, render=lambda c: render_inspect(c, doc))
