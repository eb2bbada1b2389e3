"""Shared pieces of the command line: the Typer app, common options, error handling.

Exit codes: 0 success; 1 a check failed; 2 bad usage or bad input (one line naming the file or
tensor); 3 runtime failure (out of memory, disk full, interrupted: the output is resumable).
"""

from __future__ import annotations

import json
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.text import Text

from dghard_cli import __version__
from dghard_cli.cli.progress import RichBar
from dghard_cli.engine.adapter_run import LoraOutputOptions
from dghard_cli.engine.memory import limit_allocator_retention
from dghard_cli.engine.progress import set_terminal_bar
from dghard_cli.errors import CheckFailed, DGHardError

set_terminal_bar(RichBar)  # the engine counts; on a terminal the command line shows a rich bar

app = typer.Typer(
    name="dghard",
    help=(
        "Repair catastrophic forgetting in fine-tuned checkpoints after the fact: spectral "
        "filtering of every weight delta (DG-Hard), merging, LoRA audits."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)

# -- shared options -------------------------------------------------------------------------
DeviceOpt = Annotated[
    str, typer.Option("--device", help="auto, cpu, cuda or cuda:N (auto: first CUDA device if present).")
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress and no summary.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="More detail; tracebacks on errors.")]
BaseArg = Annotated[str, typer.Argument(help="Base checkpoint: a directory or a Hub id org/name.")]
FtArg = Annotated[str, typer.Argument(help="Fine-tuned checkpoint: a directory or a Hub id.")]
IncludeOpt = Annotated[
    Optional[list[str]], typer.Option(help="Only tensors whose name matches this regex (repeatable).")
]
ExcludeOpt = Annotated[
    Optional[list[str]], typer.Option(help="Skip tensors whose name matches this regex (repeatable).")
]
RevisionOpt = Annotated[Optional[str], typer.Option("--revision", help="Hub revision of FT.")]
BaseRevisionOpt = Annotated[Optional[str], typer.Option("--base-revision", help="Hub revision of BASE.")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace a non-empty OUT.")]
JsonOpt = Annotated[
    bool,
    typer.Option(
        "--json", help="Print the machine-readable result (one JSON document) on stdout and nothing else."
    ),
]


# -- output format of repair and merge (a PEFT LoRA adapter or a full checkpoint) ---------------
FormatOpt = Annotated[
    str,
    typer.Option(
        "--format",
        help="Output: auto (an adapter when every FT is a PEFT LoRA adapter, else a full checkpoint), "
        "full, or peft (a PEFT LoRA adapter whose per-module rank is the kept rank).",
    ),
]
MergeOpt = Annotated[
    bool,
    typer.Option(
        "--merge",
        help="FT is a LoRA adapter: write the full merged checkpoint (BASE + ΔW, as PEFT's merge_and_unload) "
        "instead of an adapter.",
    ),
]
RankOpt = Annotated[
    Optional[int],
    typer.Option(
        "--rank",
        help="--format peft: truncate each module's update to this rank with the exact SVD (needed when "
        "the update is not low-rank: TIES, DARE, strengths of full fine-tunes); the energy lost is reported.",
    ),
]


def lora_options(fmt: str, merge: bool, rank: int | None) -> LoraOutputOptions:
    """The library's output options from ``--format``, ``--merge`` and ``--rank``."""
    return LoraOutputOptions(format=fmt.strip().lower(), merge=merge, rank=rank)


def is_adapter_doc(doc: dict) -> bool:
    return (doc.get("output") or {}).get("format") == "peft"


def _err_console() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def _fail(message: str, code: int) -> None:
    line = " ".join(message.split())
    if line:
        _err_console().print(Text(f"dghard: error: {line}"))
    raise typer.Exit(code)


def _on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_cli(fn: Callable[[], Any], *, verbose: bool) -> Any:
    """Run a command body, mapping errors to one-line messages and exit codes."""
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return fn()
    except DGHardError as exc:
        if verbose:
            traceback.print_exc()
        _fail(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        _fail("interrupted (run the same command again to resume)", 3)
    except typer.Exit:
        raise
    except Exception as exc:  # a bug or an unexpected runtime failure
        if verbose:
            traceback.print_exc()
        _fail(f"internal error: {type(exc).__name__}: {exc} (rerun with --verbose for a traceback)", 3)
    finally:
        signal.signal(signal.SIGTERM, previous)


def check_failed(reason: str) -> None:
    """Exit 1 (a check failed) through :func:`run_cli`, the one exit path: ``reason`` is the
    one line on stderr ("" prints nothing: the command's output already says why)."""

    def fail() -> None:
        raise CheckFailed(reason)

    run_cli(fail, verbose=False)


def emit(doc: dict, *, as_json: bool, quiet: bool, render: Callable[[Console], None]) -> None:
    if as_json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        sys.stdout.flush()
    elif not quiet:
        # logs are not terminals: use a wide line instead of rich's default of 80 columns
        render(Console(highlight=False, width=None if sys.stdout.isatty() else 200))


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dghard {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        Optional[bool],
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit."),
    ] = None,
) -> None:
    """dghard: repair, merge and audit fine-tuned checkpoints."""
    limit_allocator_retention()
