"""The sweep's evaluation cache: one JSON record per evaluation (and a copy of its results
file), keyed by a digest of what was evaluated and how, so an interrupted sweep resumes without
evaluating anything twice."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dghard_cli.errors import InputError
from dghard_cli.io.atomic import copy_file_atomic, write_json_atomic
from dghard_cli.io.checkpoint import Checkpoint
from dghard_cli.io.files import read_json, realpath


def digest(doc: object) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:32]


def input_identity(ck: Checkpoint) -> dict:
    """What the cache knows an input by: its resolved path, and each shard's size and mtime."""
    files = []
    for shard in ck.shards:
        st = (ck.path / shard).stat()
        files.append([shard, st.st_size, st.st_mtime_ns])
    return {"path": str(ck.path.resolve()), "files": files}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()) if Path(path).exists() else 0


def write_json(path: Path, doc: object) -> None:
    write_json_atomic(path, doc, default=str)


class Cache:
    """One JSON record per evaluation (and a copy of its results file), keyed by a digest."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "cache"
        self.dir.mkdir(parents=True, exist_ok=True)
        #: the records this run has read or written: they must stay (:meth:`missing`)
        self.held: set[Path] = set()

    def missing(self) -> list[Path]:
        """Records this run read or wrote that are no longer there (something deleted them)."""
        return sorted(p for p in self.held if not p.is_file())

    def get(self, key: str) -> dict | None:
        path = self.dir / f"{key}.json"
        try:
            rec = read_json(path, what="cache record", roots=(realpath(self.dir),))
        except InputError:
            return None
        if not isinstance(rec, dict) or rec.get("key") != key:
            return None
        if rec.get("results") and not (self.dir / rec["results"]).is_file():
            return None
        self.held.add(path)
        return rec

    def put(self, key: str, rec: dict, results: Path | None) -> dict:
        rec = dict(rec, key=key)
        if results is not None:
            name = f"{key}.results.json"
            copy_file_atomic(results, self.dir / name, what="results file")
            rec["results"] = name
        else:
            rec["results"] = None
        write_json(self.dir / f"{key}.json", rec)
        self.held.add(self.dir / f"{key}.json")
        return rec

    def results_path(self, rec: dict) -> Path | None:
        return self.dir / rec["results"] if rec.get("results") else None
