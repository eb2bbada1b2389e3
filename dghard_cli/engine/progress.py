"""Progress on stderr: a live bar on a terminal, plain periodic lines in logs, or nothing.

The engine only counts; how a terminal shows the count is the command line's business: it
installs a :class:`TerminalBar` factory with :func:`set_terminal_bar` (the CLI's is a rich bar,
:mod:`dghard_cli.cli.progress`). Without one, a terminal gets the plain lines too.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Protocol


class TerminalBar(Protocol):
    """A live display of one :class:`Progress` on a terminal."""

    def advance(self, nbytes: int, done_tensors: int) -> None: ...

    def close(self) -> None: ...


#: Makes the bar of a Progress: ``(label, total_bytes, total_tensors) -> TerminalBar``.
BarFactory = Callable[[str, int, int], TerminalBar]
_terminal_bar: BarFactory | None = None


def set_terminal_bar(factory: BarFactory | None) -> None:
    """Show progress on a terminal with bars made by ``factory`` (None: plain lines)."""
    global _terminal_bar
    _terminal_bar = factory


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


class Progress:
    """Counts bytes written and tensors done; shows them as suits the output stream."""

    def __init__(
        self,
        total_bytes: int,
        total_tensors: int,
        *,
        label: str,
        quiet: bool = False,
        interval: float = 10.0,
        what: str = "to write",
    ) -> None:
        self.total_bytes = max(1, total_bytes)
        self.total_tensors = total_tensors
        self.label = label
        self.done_bytes = 0
        self.done_tensors = 0
        self.quiet = quiet
        self.interval = interval
        self._t0 = time.monotonic()
        self._last = self._t0
        self._bar: TerminalBar | None = None
        if not quiet and _terminal_bar is not None and sys.stderr.isatty():
            self._bar = _terminal_bar(label, self.total_bytes, total_tensors)
        elif not quiet:
            print(
                f"[dghard] {label}: {total_tensors} tensors, {_fmt_bytes(total_bytes)} {what}",
                file=sys.stderr,
                flush=True,
            )

    def advance(self, nbytes: int, tensors: int = 1) -> None:
        self.done_bytes += nbytes
        self.done_tensors += tensors
        if self._bar is not None:
            self._bar.advance(nbytes, self.done_tensors)
        elif not self.quiet:
            now = time.monotonic()
            if now - self._last >= self.interval or self.done_tensors == self.total_tensors:
                self._last = now
                pct = 100.0 * self.done_bytes / self.total_bytes
                print(
                    f"[dghard] {self.label}: {pct:5.1f} %  {self.done_tensors}/{self.total_tensors} tensors  "
                    f"{_fmt_bytes(self.done_bytes)}  {now - self._t0:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def notice(message: str, *, warning: bool = False) -> None:
    """One line on stderr about the run (a resumed run, a warning about the inputs): plain
    text, so it reads the same on a terminal and in a log."""
    prefix = "dghard: warning: " if warning else "[dghard] "
    print(prefix + " ".join(message.split()), file=sys.stderr, flush=True)
