"""Progress on stderr: a rich bar on a terminal, plain periodic lines in logs, or nothing."""

from __future__ import annotations

import sys
import time


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
        self._rich = None
        self._task = None
        if not quiet and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )
            from rich.progress import Progress as RP

            self._rich = RP(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TextColumn("{task.fields[tensors]}"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._rich.start()
            self._task = self._rich.add_task(
                label, total=self.total_bytes, tensors=f"0/{total_tensors} tensors"
            )
        elif not quiet:
            print(
                f"[dghard] {label}: {total_tensors} tensors, {_fmt_bytes(total_bytes)} {what}",
                file=sys.stderr,
                flush=True,
            )

    def advance(self, nbytes: int, tensors: int = 1) -> None:
        self.done_bytes += nbytes
        self.done_tensors += tensors
        if self._rich is not None:
            self._rich.update(
                self._task, advance=nbytes, tensors=f"{self.done_tensors}/{self.total_tensors} tensors"
            )
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
        if self._rich is not None:
            self._rich.stop()
            self._rich = None
