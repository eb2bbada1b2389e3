"""The terminal size the command line believes (no import of the other command modules, so
both the console entry and the app callback can use it)."""

from __future__ import annotations

#: The widest and tallest terminal believed: rich and typer size their buffers from COLUMNS and
#: LINES, and COLUMNS=99999999999999999999 made even `dghard --help` an OverflowError traceback.
MAX_TERMINAL_CELLS = 10_000


def sane_terminal_size() -> None:
    """Drop COLUMNS and LINES unless each is a whole number from 1 to MAX_TERMINAL_CELLS (the
    terminal's own size is used instead, as where they are unset)."""
    import os

    for name in ("COLUMNS", "LINES"):
        raw = os.environ.get(name)
        if raw is None:
            continue
        text = raw.strip()
        ok = text.isascii() and text.isdigit() and len(text) <= 5 and 1 <= int(text) <= MAX_TERMINAL_CELLS
        if not ok:
            del os.environ[name]
