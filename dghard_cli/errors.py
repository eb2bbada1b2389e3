"""Errors that map to the command-line exit codes.

Every error the tool raises on purpose is a :class:`DGHardError`; the CLI prints its message
as one line and exits with its ``exit_code``. Anything else is a bug or a runtime failure
(exit 3).
"""

from __future__ import annotations


class DGHardError(Exception):
    """Base class: a failure with a one-line, user-facing message."""

    exit_code = 3

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"


class InputError(DGHardError):
    """Bad usage or bad input: a file, a tensor, an option. Exit code 2."""

    exit_code = 2


class CheckFailed(DGHardError):
    """A check the user asked for failed (audit findings, a score gate). Exit code 1."""

    exit_code = 1


class RuntimeFailure(DGHardError):
    """Out of memory, disk full, interrupted. Exit code 3; the output is left resumable."""

    exit_code = 3


class Interrupted(RuntimeFailure):
    """SIGINT/SIGTERM: the work done so far is journaled; ``--resume`` continues it."""
