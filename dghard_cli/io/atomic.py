"""Atomic writes and directory swaps: a reader sees the old file (or directory) or the new one,
never a half-written one.

Every file that is replaced in place (reports, journals, caches) is written next to its target
as ``NAME.tmp`` (created afresh, never written through) and renamed over it; an output directory is moved into place by
:func:`swap_dir_into_place`, which keeps the previous OUT aside until the rename succeeded.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from dghard_cli.errors import InputError
from dghard_cli.io import files
from dghard_cli.io.report_json import json_text


def _tmp(path: Path) -> Path:
    """``NAME.tmp`` beside ``path``, removed first: a leftover (or a symlink planted there) is
    never written through; the file is then created exclusively."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    return tmp


def write_text_atomic(path: Path, text: str, *, fsync: bool = False) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through ``path.tmp`` and a rename (``path.tmp`` is
    removed when writing fails: disk full, permission denied)."""
    path = Path(path)
    tmp = _tmp(path)
    try:
        with open(tmp, "x", encoding="utf-8") as fh:
            fh.write(text)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_json_atomic(path: Path, doc: object, **dumps) -> Path:
    """``doc`` as strict JSON (:func:`dghard_cli.io.report_json.json_text`), written atomically."""
    return write_text_atomic(path, json_text(doc, **dumps))


def copy_file_atomic(
    source: Path, target: Path, *, what: str = "file", roots: Sequence[Path] | None = None
) -> Path:
    """Copy ``source`` in full to ``target`` atomically; the source is read through the
    file-access layer (:func:`dghard_cli.io.files.copy_input`: a regular file, inside ``roots``)."""
    tmp = _tmp(Path(target))
    try:
        files.copy_input(source, tmp, what=what, roots=roots)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return Path(target)


def swap_dir_into_place(source: Path, out: Path, *, overwrite: bool, during: str) -> Path:
    """Rename the finished directory ``source`` to ``out``.

    An empty ``out`` is replaced; a non-empty one only with ``overwrite`` (InputError naming
    ``during``, e.g. "running", otherwise): it is renamed to ``.OUT.dghard-old`` first and
    removed once the new one is in place.
    """
    backup = None
    if out.exists():
        if any(out.iterdir()):
            if not overwrite:
                raise InputError(f"output {out} appeared while {during}; pass --overwrite")
            backup = out.parent / f".{out.name}.dghard-old"
            if backup.exists():
                shutil.rmtree(backup)
            os.replace(out, backup)
        else:
            out.rmdir()
    os.replace(source, out)
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)
    return out
