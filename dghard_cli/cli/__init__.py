"""The ``dghard`` command line: a thin layer over the library API.

Exit codes: 0 success; 1 a check failed; 2 bad usage or bad input (one line naming the file or
tensor); 3 runtime failure (out of memory, disk full, interrupted: the output is resumable).
Each command lives in :mod:`dghard_cli.cli` and registers itself on ``app``.
"""

from __future__ import annotations

from dghard_cli.cli import audit_lora, inspect, merge, repair, report, score, sweep, verify  # noqa: F401  (each registers its command)
from dghard_cli.cli.common import app


def entrypoint() -> None:
    from dghard_cli.cli import interrupts

    interrupts.KEEP_IGNORING = True  # the process ends with the command: no handler to restore
    app()
