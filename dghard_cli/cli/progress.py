"""The live progress bar of a terminal (rich), installed into the engine's progress counter."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.progress import Progress as RichProgress


class RichBar:
    """Bytes written (with speed and time left) and tensors done, on stderr; gone when closed."""

    def __init__(self, label: str, total_bytes: int, total_tensors: int) -> None:
        self.total_tensors = total_tensors
        self._rich = RichProgress(
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
        self._task = self._rich.add_task(label, total=total_bytes, tensors=f"0/{total_tensors} tensors")

    def advance(self, nbytes: int, done_tensors: int) -> None:
        self._rich.update(self._task, advance=nbytes, tensors=f"{done_tensors}/{self.total_tensors} tensors")

    def close(self) -> None:
        self._rich.stop()
