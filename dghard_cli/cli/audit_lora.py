"""``dghard audit-lora``."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dghard_cli.cli.common import (
    DeviceOpt,
    JsonOpt,
    QuietOpt,
    VerboseOpt,
    app,
    check_failed,
    choices,
    emit,
    run_cli,
)
from dghard_cli.lora.findings import LEVELS

AUDIT_EPILOG = """
**Examples**

    dghard audit-lora ./my-adapter                       # table of findings, exit 0/1

    dghard audit-lora org/some-adapter --base Qwen/Qwen2.5-7B --fail-on warn --json > audit.json

    dghard audit-lora ./my-adapter --base ./base --top-k 0      # skip intruder dimensions

Exit codes: 0 no finding at or above --fail-on; 1 there is one; 2 unreadable input.
"""


@app.command("audit-lora", epilog=AUDIT_EPILOG)
def audit_lora_cmd(
    adapter: Annotated[str, typer.Argument(help="PEFT LoRA adapter: a directory or a Hub id org/name.")],
    base: Annotated[
        Optional[str],
        typer.Option(
            help="Base checkpoint (directory or Hub id): check the declared base, module shapes, the "
            "update's size against the base weights, and intruder dimensions. Streamed one tensor at a time."
        ),
    ] = None,
    revision: Annotated[Optional[str], typer.Option(help="Hub revision of ADAPTER.")] = None,
    base_revision: Annotated[Optional[str], typer.Option(help="Hub revision of BASE.")] = None,
    fail_on: Annotated[
        str,
        typer.Option(
            "--fail-on",
            metavar=choices(reversed(LEVELS)),
            help="Exit 1 when a finding reaches this level: error, warn or info.",
        ),
    ] = "error",
    top_k: Annotated[
        int,
        typer.Option(
            "--top-k",
            help="Intruder dimensions: how many top singular vectors of W_base + ΔW to test (0 skips).",
        ),
    ] = 10,
    epsilon: Annotated[
        float,
        typer.Option(
            "--epsilon",
            help="Intruder dimensions: a top vector whose best |cosine| with every base singular vector is below this is an intruder.",
        ),
    ] = 0.5,
    device: DeviceOpt = "auto",
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Audit a PEFT LoRA adapter: config, tensor set, shapes, NaN/zero factors, spectra; with --base,
    the base identity, shapes and intruder dimensions."""
    from dghard_cli.audit.auditor import audit_lora

    def body() -> dict:
        return audit_lora(
            adapter,
            base,
            fail_on=fail_on.strip().lower(),
            k=top_k,
            eps=epsilon,
            revision=revision,
            base_revision=base_revision,
            device=device,
            progress=not (quiet or json_out),
        )

    doc = run_cli(body, verbose=verbose)
    from dghard_cli.cli.render import render_findings

    emit(doc, as_json=json_out, quiet=quiet, render=lambda c: render_findings(c, doc, verbose))
    if doc["summary"]["failed"]:
        check_failed("")  # the findings printed (or the JSON) say why
