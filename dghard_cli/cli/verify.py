"""``dghard verify``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from dghard_cli.cli.common import JsonOpt, QuietOpt, VerboseOpt, app, emit, run_cli
from dghard_cli.errors import CheckFailed, InputError

EPILOG = """
**Examples**

    dghard verify ./repaired            # headers, index, report, sha256, NaN/Inf scan

    dghard verify ./repaired --quick    # headers, index and sizes only (says what it skipped)

    dghard verify ./adapter --base BASE # a PEFT adapter dghard wrote, its shapes checked against BASE
"""


@app.command("verify", epilog=EPILOG)
def verify_cmd(
    directory: Annotated[
        Path, typer.Argument(help="A model directory written by dghard (or any safetensors checkpoint).")
    ],
    quick: Annotated[bool, typer.Option("--quick", help="Skip hashing and the NaN/Inf scan.")] = False,
    base: Annotated[
        Optional[str],  # noqa: UP045 - typer reads the annotation at run time
        typer.Option("--base", help="An adapter directory: check its modules' shapes against this BASE."),
    ] = None,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Re-check a written model directory: exit 0 if sound, 1 if a check fails, 2 if unreadable."""

    def body() -> None:
        from dghard_cli.cli.render import render_verify
        from dghard_cli.verification import verify_directory

        if not directory.is_dir():
            raise InputError(f"{directory}: no such directory")
        base_ck = None
        if base is not None:  # an unreadable BASE is bad input (exit 2), not a failed check
            from dghard_cli.io.hub import open_checkpoint

            base_ck = open_checkpoint(base, label="BASE")
        try:
            doc = verify_directory(directory, deep=not quick, base=base_ck)
        except InputError as exc:
            raise CheckFailed(f"verification failed: {exc}") from None
        finally:
            if base_ck is not None:
                base_ck.close()

        emit(doc, as_json=json_out, quiet=quiet, render=lambda c: render_verify(c, directory, doc))

    run_cli(body, verbose=verbose)
