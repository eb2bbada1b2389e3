"""The output-directory rule that needs no model: checked by the command line before it imports
torch, so that re-running a command on an OUT that is already there says so at once, not after
seconds of imports. The library checks the full rule again (:func:`dghard_cli.io.output.check_out_path`:
overlap with an input, a missing parent), with the same messages."""

from __future__ import annotations

from pathlib import Path

from dghard_cli.errors import InputError


def precheck_out(out: str | Path, *, overwrite: bool) -> None:
    """InputError when OUT exists and is not a directory, or is a non-empty directory without
    ``overwrite``; anything this cannot look up is left to the full check."""
    p = Path(out).expanduser()
    try:
        if p.is_dir():
            if not overwrite and any(p.iterdir()):
                raise InputError(f"output {out} exists and is not empty; pass --overwrite to replace it")
        elif p.exists():
            raise InputError(f"output {out} exists and is not a directory")
    except OSError:
        return
