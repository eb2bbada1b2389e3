"""Errors that map to the command-line exit codes.

Every error the tool raises on purpose is a :class:`DGHardError`; the CLI prints its message
as one line and exits with its ``exit_code``. Anything else is a bug or a runtime failure
(exit 3).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Advice:
    """Advice that names options, rendered with only those the running command has.

    ``template`` holds ``{options}``, replaced by the offered ones comma-joined; with none of
    them offered the advice is left out. Plain data, so an error still pickles across
    processes (the sweep's executors)."""

    options: tuple[str, ...]
    template: str
    sep: str = ", "

    def render(self, offered: frozenset[str] | None) -> str | None:
        named = [o for o in self.options if offered is None or o in offered]
        return self.template.format(options=", ".join(named)) if named else None


class DGHardError(Exception):
    """Base class: a failure with a one-line, user-facing message."""

    exit_code = 3

    def __init__(self, message: str, *, hint: str | None = None, advice: Advice | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.advice = advice

    def text_for(self, options: frozenset[str] | None = None) -> str:
        """The message, its advice naming only options in ``options`` (the running command's;
        None: every option it names). A NaN refusal of ``merge`` advised ``--allow-nonfinite``,
        which only ``repair`` has; an overflow of ``repair --lines`` advised ``--weights``."""
        text = self.message
        if self.advice is not None and (clause := self.advice.render(options)):
            text = f"{text}{self.advice.sep}{clause}"
        return text if not self.hint else f"{text} ({self.hint})"

    def __str__(self) -> str:
        return self.text_for(None)


#: The advice of a NaN/Inf refusal (the CLI keeps it for the commands that have the option).
KEEP_NONFINITE = Advice(("--allow-nonfinite",), "or pass {options} to keep such tensors as they are")


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
