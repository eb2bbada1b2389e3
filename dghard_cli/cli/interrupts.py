"""Ctrl-C and SIGTERM: the first one stops the run, the next ones cannot break the cleanup.

The first SIGINT or SIGTERM raises :class:`KeyboardInterrupt` in the main thread; the command
then discards the shard in flight, keeps its journal, stops its threads (and an evaluation's
process group) and exits 3 with one line. A second Ctrl-C used to land inside that cleanup —
in a ``finally``, a thread join, an ``atexit`` hook — and kill the interpreter mid-way (exit −2
or −6, tracebacks, a half-removed candidate). From the first signal on, further ones are
ignored until the process ends: the cleanup is short and bounded (the writer is joined with a
timeout, an evaluation's group is killed after a grace period), and SIGKILL still works.
"""

from __future__ import annotations

import signal
from typing import Any

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class InterruptGuard:
    """Installs the handlers for the duration of a command (main thread only)."""

    def __init__(self, *, keep_ignoring: bool = False) -> None:
        #: after an interruption, leave further signals ignored when the command returns (the
        #: real command line, whose interpreter is about to exit); tests restore the handlers
        self.keep_ignoring = keep_ignoring
        self.interrupted = False
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:  # noqa: ARG002 - signal handler signature
        if self.interrupted:
            return
        self.interrupted = True
        for s in _SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        raise KeyboardInterrupt

    def __enter__(self) -> InterruptGuard:
        try:
            for s in _SIGNALS:
                self._previous[s] = signal.signal(s, self._handler)
        except ValueError:  # not the main thread: leave signals alone
            self._previous.clear()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.interrupted and self.keep_ignoring:
            return
        for s, h in self._previous.items():
            signal.signal(s, h)


#: Set by the command-line entry point: the process ends right after the command.
KEEP_IGNORING = False
