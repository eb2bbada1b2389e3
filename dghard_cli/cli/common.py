"""Shared pieces of the command line: the Typer app, common options, error handling.

Exit codes: 0 success; 1 a check failed; 2 bad usage or bad input (one line naming the file or
tensor); 3 runtime failure (out of memory, disk full, interrupted: the output is resumable).
"""

from __future__ import annotations

import errno
import io
import os
import sys
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import click
import typer
from rich.console import Console
from rich.text import Text
from typer.core import TyperCommand, TyperGroup

from dghard_cli._version import __version__
from dghard_cli.cli import interrupts
from dghard_cli.cli.interrupts import InterruptGuard
from dghard_cli.cli.progress import RichBar
from dghard_cli.engine.memory import limit_allocator_retention
from dghard_cli.engine.memory_budget import is_gpu_out_of_memory, is_out_of_memory, out_of_memory_message
from dghard_cli.engine.progress import set_terminal_bar
from dghard_cli.errors import CheckFailed, DGHardError

set_terminal_bar(RichBar)  # the engine counts; on a terminal the command line shows a rich bar

if TYPE_CHECKING:
    from dghard_cli.lora.output import LoraOutputOptions


# typer 0.29's rich help prints every option's value type, and `<bool>` for a flag, which takes
# no value. typer shows an option's ``metavar`` in that column when one is set, so a flag gets
# an empty one (click ignores a flag's metavar everywhere else), and options with a fixed set of
# values get ``metavar=choices(...)``: the values stay plain strings, checked by the library
# with its one-line errors (a ``Literal`` annotation would list them too, but its bad values
# would be typer's multi-line error box).
def choices(values: Iterable[str]) -> str:
    """The help's type column for an option taking one of ``values``: ``a|b|c``."""
    return "|".join(values)


def _blank_flag_types(params: list) -> list:
    for p in params:
        if getattr(p, "is_flag", False) and not getattr(p, "count", False) and p.metavar is None:
            p.metavar = ""
    return params


class _Command(TyperCommand):
    def get_params(self, ctx: click.Context) -> list:
        return _blank_flag_types(super().get_params(ctx))


class _Group(TyperGroup):
    def get_params(self, ctx: click.Context) -> list:
        return _blank_flag_types(super().get_params(ctx))


class _App(typer.Typer):
    """Every command of ``app`` is a :class:`_Command` (flags show no type in the help)."""

    def command(self, *args: Any, cls: type[TyperCommand] | None = None, **kwargs: Any):  # type: ignore[override]
        return super().command(*args, cls=cls or _Command, **kwargs)


app = _App(
    cls=_Group,
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
DEVICES = ("auto", "cpu", "cuda", "cuda:N")
DeviceOpt = Annotated[
    str,
    typer.Option(
        "--device",
        metavar=choices(DEVICES),
        help="auto, cpu, cuda or cuda:N (auto: first CUDA device if present).",
    ),
]
#: The output dtypes ``--dtype`` takes (more spellings are accepted, see safetensors_format).
DTYPE_CHOICES = ("bf16", "fp16", "fp32", "fp64")
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress and no summary.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="More detail; tracebacks on errors.")]
BaseArg = Annotated[str, typer.Argument(help="Base checkpoint: a directory or a Hub id org/name.")]
FtArg = Annotated[
    str,
    typer.Argument(help="Fine-tuned checkpoint, or a PEFT LoRA adapter of BASE: a directory or a Hub id."),
]
IncludeOpt = Annotated[
    Optional[list[str]], typer.Option(help="Only tensors whose name matches this regex (repeatable).")
]
ExcludeOpt = Annotated[
    Optional[list[str]], typer.Option(help="Skip tensors whose name matches this regex (repeatable).")
]
RevisionOpt = Annotated[Optional[str], typer.Option("--revision", help="Hub revision of FT.")]
BaseRevisionOpt = Annotated[Optional[str], typer.Option("--base-revision", help="Hub revision of BASE.")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace a non-empty OUT.")]
# -- the options of every command that writes a model (repair, merge), declared once ----------------
ShardSizeOpt = Annotated[
    Optional[str], typer.Option(help="Output shard size, e.g. 5GB (default: mirror the first FT's shards).")
]
DtypeOpt = Annotated[
    Optional[str],
    typer.Option(metavar=choices(DTYPE_CHOICES), help="Output dtype of floating tensors (default: FT's)."),
]
ReportOpt = Annotated[
    Optional[Path], typer.Option(help="Where to write the JSON report (default OUT/dghard_report.json).")
]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Plan only; read headers, run no model.")]
ResumeOpt = Annotated[
    bool, typer.Option("--resume", help="Require resuming an interrupted run of the same command.")
]
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
        help="--format peft: cut each module's update to this rank with the exact SVD (needed when it is "
        "not low-rank: TIES, DARE); the energy lost is reported.",
    ),
]


AllowLossyOpt = Annotated[
    bool,
    typer.Option(
        "--allow-lossy",
        help="Adapter output: write it even when the default rank limit cuts the update (refused "
        "otherwise); the report says the energy kept.",
    ),
]


CoreSpaceOpt = Annotated[
    bool,
    typer.Option(
        "--core-space",
        help="Adapters in, adapter out: merge in their shared core space (docs/lora.md).",
    ),
]


def lora_options(
    fmt: str, merge: bool, rank: int | None, allow_lossy: bool = False, core_space: bool = False
) -> LoraOutputOptions:
    """The library's output options from ``--format``, ``--merge``, ``--rank``, ``--allow-lossy``
    and ``--core-space``."""
    from dghard_cli.lora.output import LoraOutputOptions

    return LoraOutputOptions(
        format=fmt.strip().lower(), merge=merge, rank=rank, allow_lossy=allow_lossy, core_space=core_space
    )


def is_adapter_doc(doc: dict) -> bool:
    return (doc.get("output") or {}).get("format") == "peft"


def _err_console() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def _fail(message: str, code: int) -> None:
    line = " ".join(message.split())
    if line:
        _err_console().print(Text(f"dghard: error: {line}"))
    raise typer.Exit(code)


def command_options() -> frozenset[str] | None:
    """The options of the command running now (None outside a click command): an error's advice
    names an option only where the command has it."""
    import importlib

    # typer >= 0.20 runs commands on a click of its own (typer._click), others on click itself
    for module in ("typer._click.globals", "click.globals"):
        try:
            ctx = importlib.import_module(module).get_current_context(silent=True)
        except (ImportError, AttributeError):
            continue
        if ctx is not None:
            params = ctx.command.params
            return frozenset(o for p in params for o in (*p.opts, *p.secondary_opts) if o.startswith("--"))
    return None


def run_cli(fn: Callable[[], Any], *, verbose: bool) -> Any:
    """Run a command body, mapping errors to one-line messages and exit codes.

    SIGINT and SIGTERM interrupt it once (:mod:`dghard_cli.cli.interrupts`): later signals
    are ignored so the cleanup finishes and the exit code is 3.
    """
    guard = InterruptGuard(keep_ignoring=interrupts.KEEP_IGNORING)
    guard.__enter__()
    try:
        return fn()
    except DGHardError as exc:
        if verbose:
            traceback.print_exc()
        _fail(exc.text_for(command_options()), exc.exit_code)
    except KeyboardInterrupt:
        _fail("interrupted (run the same command again to resume)", 3)
    except typer.Exit:
        raise
    except OSError as exc:
        from dghard_cli.io.files import RESOURCE_ERRNOS

        if verbose:
            traceback.print_exc()
        if exc.errno in RESOURCE_ERRNOS or exc.errno == errno.EFBIG:
            # the machine, not the input or a bug: any write that has no message of its own
            from dghard_cli.io.files import write_error

            err = write_error(exc.filename or "a file", "an output", exc)
            _fail(str(err), err.exit_code)
        _fail(f"internal error: {type(exc).__name__}: {exc} (rerun with --verbose for a traceback)", 3)
    except Exception as exc:  # a bug or an unexpected runtime failure
        if verbose:
            traceback.print_exc()
        if is_out_of_memory(exc):  # outside the writer (a plan, calibration passes): not a bug
            if is_gpu_out_of_memory(exc):
                _fail("CUDA out of memory (rerun the same command, or with --device cpu)", 3)
            _fail(f"{out_of_memory_message(exc)} (free memory and run the command again)", 3)
        _fail(f"internal error: {type(exc).__name__}: {exc} (rerun with --verbose for a traceback)", 3)
    finally:
        guard.__exit__()


def check_failed(reason: str) -> None:
    """Exit 1 (a check failed) through :func:`run_cli`, the one exit path: ``reason`` is the
    one line on stderr ("" prints nothing: the command's output already says why)."""

    def fail() -> None:
        raise CheckFailed(reason)

    run_cli(fail, verbose=False)


class _TrimmedLines(io.TextIOBase):
    """Writes whole lines to ``out`` without their trailing blanks.

    rich pads every row of a table to the table's width, so in a log each short row ends in a
    run of spaces (up to the console's width); a log reader wants the text only.
    """

    def __init__(self, out) -> None:
        super().__init__()
        self._out = out
        self._partial = ""

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._out, "encoding", None) or "utf-8"

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            self._out.write(line.rstrip(" ") + "\n")
        return len(text)

    def flush(self) -> None:
        self._out.flush()

    def finish(self) -> None:
        if self._partial:
            self._out.write(self._partial.rstrip(" "))
            self._partial = ""
        self._out.flush()


def emit(doc: dict, *, as_json: bool, quiet: bool, render: Callable[[Console], None]) -> None:
    if as_json:
        from dghard_cli.io.report_json import json_text

        sys.stdout.write(json_text(doc))
        sys.stdout.flush()
    elif not quiet:
        if sys.stdout.isatty():
            render(Console(highlight=False))
            return
        # a log: lines as wide as their content (no padding), wrapped at $COLUMNS when it is
        # set, else at 200 columns rather than rich's default of 80
        columns = os.environ.get("COLUMNS", "").strip()
        out = _TrimmedLines(sys.stdout)
        render(Console(highlight=False, width=None if columns.isdigit() else 200, file=out))
        out.finish()


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
    from dghard_cli.cli.terminal import sane_terminal_size

    sane_terminal_size()  # the console script does it first; in-process callers reach here
    limit_allocator_retention()
