"""Did the evaluation command change the checkpoint it evaluated?

The sweep hands the evaluation a candidate it has just written. An evaluation that writes
into ``{model}`` (plants a file, rewrites a shard, flips a byte) would otherwise have its
scores credited to weights the printed command does not produce, and could move those bytes
into OUT. So the sweep takes a :func:`snapshot` of the candidate right after writing it:

- every entry below it (files, directories, symlinks) with its inode, size, modification and
  *change* time — any write, ``chmod``, ``utime`` or replacement changes the change time, which
  user space cannot set back;
- every file's sha256: the shards' from the writer's own journal (recorded while they were
  streamed, so nothing is read twice), the small side files' computed here.

After each evaluation :func:`changed` compares the cheap fields (the candidate is then reported
``failed`` and its results discarded); before the winner is moved into OUT
:func:`verify_hashes` re-reads it against the recorded sha256 (a mismatch: the winner is
written again) — which also catches a change made within the file system's timestamp
granularity (a few milliseconds) of the snapshot.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

REPORT_NAME = "dghard_report.json"


def _entries(directory: Path) -> dict[str, os.stat_result]:
    out: dict[str, os.stat_result] = {}
    for dirpath, dirnames, filenames in os.walk(directory, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            out[os.path.relpath(p, directory)] = os.lstat(p)
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(16 * 1024 * 1024):
            h.update(block)
    return h.hexdigest()


def snapshot(directory: Path) -> dict:
    """What the candidate is right after writing: per entry its kind, inode, size, times, sha256."""
    directory = Path(directory)
    known: dict[str, str] = {}
    try:
        report = json.loads((directory / REPORT_NAME).read_text(encoding="utf-8"))
        for f in (report.get("output") or {}).get("files") or []:
            known[str(f["name"])] = str(f["sha256"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        known = {}
    entries = {}
    for rel, st in _entries(directory).items():
        e = {
            "mode": stat.S_IFMT(st.st_mode),
            "ino": st.st_ino,
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns,
        }
        if stat.S_ISREG(st.st_mode):
            e["sha256"] = known.get(rel) or _sha256(directory / rel)
        entries[rel] = e
    return {"entries": entries}


def changed(directory: Path, snap: dict | None) -> str | None:
    """What differs from the snapshot (cheap: no file is read), or None."""
    if not snap:
        return None
    before = snap.get("entries") or {}
    try:
        now = _entries(Path(directory))
    except OSError as exc:
        return f"it cannot be listed any more ({exc.strerror})"
    added = sorted(set(now) - set(before))
    if added:
        return f"{added[0]!r} was added"
    removed = sorted(set(before) - set(now))
    if removed:
        return f"{removed[0]!r} was removed"
    for rel, e in before.items():
        st = now[rel]
        if stat.S_IFMT(st.st_mode) != e["mode"] or st.st_ino != e["ino"]:
            return f"{rel!r} was replaced"
        if stat.S_ISREG(st.st_mode) and (
            st.st_size != e["size"] or st.st_mtime_ns != e["mtime_ns"] or st.st_ctime_ns != e["ctime_ns"]
        ):
            return f"{rel!r} was modified"
    return None


def verify_hashes(directory: Path, snap: dict | None) -> str | None:
    """Every file re-read against its recorded sha256 (and the cheap checks); None if intact."""
    if not snap:
        return None
    problem = changed(directory, snap)
    if problem:
        return problem
    for rel, e in (snap.get("entries") or {}).items():
        if "sha256" in e and _sha256(Path(directory) / rel) != e["sha256"]:
            return f"{rel!r} no longer has the sha256 recorded when it was written"
    return None
