"""The ``dghard`` command line: a thin layer over the library API.

Exit codes: 0 success; 1 a check failed; 2 bad usage or bad input (one line naming the file or
tensor); 3 runtime failure (out of memory, disk full, interrupted: the output is resumable).

Every command is one module of this package that registers itself on ``app`` (cli/common.py)
when imported; :data:`COMMANDS` lists them all, in the order ``dghard --help`` shows them.
The console script imports only the module of the command it runs (``dghard merge ...``
imports ``cli/merge.py`` alone) and holds torch and numpy back until a command uses them
(cli/deferred.py), so ``dghard --version`` and ``dghard COMMAND --help`` start in a blink.
``from dghard_cli.cli import app`` gives the app with every command registered.
"""

from __future__ import annotations

import sys
from importlib import import_module

#: command name -> the module (in this package) that registers it
COMMANDS = {
    "audit-lora": "audit_lora",
    "inspect": "inspect",
    "merge": "merge",
    "repair": "repair",
    "report": "report",
    "score": "score",
    "sweep": "sweep",
    "verify": "verify",
}


def load_commands(names: list[str] | None = None) -> None:
    """Register the commands ``names`` (default: every command) on the app."""
    for name in COMMANDS if names is None else names:
        import_module(f"{__name__}.{COMMANDS[name]}")


def invoked_command(argv: list[str]) -> str | None:
    """The command a command line runs: its first word that is not an option (the app's own
    options, --version, --help and the completion ones, take no value)."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in COMMANDS else None


def entrypoint() -> None:
    from dghard_cli.cli import deferred, interrupts

    deferred.defer()  # torch and numpy are imported where a command first uses them
    from dghard_cli.cli.terminal import sane_terminal_size

    sane_terminal_size()
    argv = sys.argv[1:]
    command = invoked_command(argv)
    if command is not None:
        load_commands([command])
    elif "--version" not in argv or "--help" in argv:  # `dghard`, `dghard --help`: the list of all
        load_commands()
    interrupts.KEEP_IGNORING = True  # the process ends with the command: no handler to restore
    from dghard_cli.cli.common import app

    try:
        app()
    except SystemExit as exc:
        if exc.code == 3:
            _exit_now(3)
        raise


def _exit_now(code: int) -> None:
    """End an interrupted or failed run (exit 3) without the C++ teardown of torch: a thread of
    the run still inside a torch call when the interpreter finalises made that teardown abort
    ("terminate called without an active exception", exit -6 instead of 3). Python's own exit
    hooks run first (OUT's lock, temporary directories); the output is already resumable."""
    import atexit
    import os

    run_exit_hooks = getattr(atexit, "_run_exitfuncs", None)
    if run_exit_hooks is not None:
        run_exit_hooks()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def __getattr__(name: str):
    if name == "app":
        load_commands()
        from dghard_cli.cli.common import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
