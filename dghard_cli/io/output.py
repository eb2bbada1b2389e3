"""Writing outputs: the one place that creates files.

Everything is written into a staging directory beside OUT (``.<OUT name>.dghard-partial``) and
renamed into place at the end, so OUT is either absent or complete. Shards are streamed: the
header is written first (every output shape and dtype is known from the plan), then each
tensor's bytes as they are produced, hashed on the way. A journal in the staging directory
records each finished shard (name, size, sha256, the report records of its tensors), so an
interrupted run resumes by verifying and skipping them; the fingerprint of the command and
its inputs decides whether a staging directory may be resumed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from dghard_cli.errors import InputError, RuntimeFailure
from dghard_cli.io.atomic import swap_dir_into_place, write_text_atomic
from dghard_cli.io.checkpoint import allowed_root, path_exists
from dghard_cli.io.safetensors_format import build_header

JOURNAL = "dghard_journal.jsonl"
STAGING_SUFFIX = ".dghard-partial"
INDEX_NAME = "model.safetensors.index.json"

#: Files copied from the fine-tune next to the weights (configs, tokenizer, chat template).
SIDE_FILE_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken", ".py")
SIDE_FILE_SKIP = {"dghard_report.json", "sweep_report.json", "README.md"}
SIDE_FILE_MAX = 64 * 1024 * 1024


def side_file_ok(path: Path, root: Path) -> bool:
    """Whether a side file of an input may be read: a regular file (links followed) whose real
    path lies inside ``root`` (the input's :func:`~dghard_cli.io.checkpoint.allowed_root`), at
    most :data:`SIDE_FILE_MAX` bytes. Anything else is skipped, never read."""
    try:
        st = path.stat()
        real = path.resolve()
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size <= SIDE_FILE_MAX and _is_within(real, root)


def read_side_text(directory: Path, name: str) -> tuple[str | None, str | None]:
    """``(text, None)`` of the UTF-8 side file ``name`` of an input directory, read under the
    rules of :func:`side_file_ok`; ``(None, why)`` when it is absent or may not be read."""
    path = Path(directory) / name
    try:
        if not os.path.lexists(path):
            return None, "absent"
    except OSError:
        return None, "absent"
    if not side_file_ok(path, allowed_root(Path(directory))):
        return None, (
            f"not read: not a regular file inside {directory}, or larger than {SIDE_FILE_MAX} bytes"
        )
    try:
        return path.read_bytes().decode("utf-8"), None
    except UnicodeDecodeError:
        return None, "not read: not UTF-8 text"
    except OSError as exc:
        return None, f"not read: {exc.strerror or exc}"


def staging_dir(out: Path) -> Path:
    """The staging directory used for OUT."""
    out = Path(out).absolute()
    return out.parent / f".{out.name}{STAGING_SUFFIX}"


def _is_within(child: Path, parent: Path) -> bool:
    try:
        child.relative_to(parent)
        return True
    except ValueError:
        return False


def check_out_path(out: Path, inputs: list[Path], *, overwrite: bool) -> None:
    """Refuse an OUT that is, contains or lies inside an input, or exists without --overwrite."""
    out_real = Path(out).expanduser().resolve()
    for inp in inputs:
        real = Path(inp).resolve()
        if out_real == real or _is_within(out_real, real) or _is_within(real, out_real):
            raise InputError(f"output {out} overlaps input {inp}; write the output to its own directory")
    if path_exists(out_real):
        if not out_real.is_dir():
            raise InputError(f"output {out} exists and is not a directory")
        if any(out_real.iterdir()) and not overwrite:
            raise InputError(f"output {out} exists and is not empty; pass --overwrite to replace it")
    if not path_exists(out_real.parent):
        raise InputError(f"output {out}: parent directory {out_real.parent} does not exist")


def check_free_space(out: Path, needed: int) -> None:
    """Refuse to start when the output's filesystem cannot hold ``needed`` bytes."""
    parent = Path(out).expanduser().resolve().parent
    try:
        free = shutil.disk_usage(parent).free
    except OSError:
        return
    margin = 64 * 1024 * 1024
    if free < needed + margin:
        raise InputError(
            f"output {out}: needs about {needed / 1e9:.2f} GB but {parent} has "
            f"{free / 1e9:.2f} GB free; free space or choose another OUT"
        )


@dataclass
class ShardRecord:
    """A finished output shard as the journal records it."""

    name: str
    size: int
    sha256: str
    tensors: list[dict]


class ShardWriter:
    """Streams one safetensors file: header first, then tensor bytes in the declared order."""

    def __init__(
        self,
        path: Path,
        entries: list[tuple[str, str, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.path = path
        header, offsets = build_header(entries, metadata)
        self._expected = [
            (name, end - begin) for (name, _, _), (begin, end) in zip(entries, offsets, strict=True)
        ]
        self._pos = 0  # index into _expected
        self._written = 0  # bytes written of the current tensor
        self._hash = hashlib.sha256()
        self._fh = open(path, "wb")  # noqa: SIM115 - closed in finish/abort
        self._size = 0
        self._put(header)
        self._skip_empty()

    def _put(self, data) -> None:
        self._fh.write(data)
        self._hash.update(data)
        self._size += len(data) if isinstance(data, bytes) else memoryview(data).nbytes

    def _skip_empty(self) -> None:
        while self._pos < len(self._expected) and self._expected[self._pos][1] == self._written:
            self._pos += 1
            self._written = 0

    @property
    def current(self) -> str | None:
        return self._expected[self._pos][0] if self._pos < len(self._expected) else None

    def write(self, name: str, data) -> None:
        """Append bytes of tensor ``name`` (must be the tensor due next)."""
        mv = memoryview(data).cast("B")
        if self.current != name:
            raise RuntimeFailure(f"internal error: {self.path.name} expected {self.current!r}, got {name!r}")
        left = self._expected[self._pos][1] - self._written
        if mv.nbytes > left:
            raise RuntimeFailure(f"internal error: too many bytes for tensor {name!r}")
        self._put(mv)
        self._written += mv.nbytes
        self._skip_empty()

    def flush(self) -> None:
        """Hand the bytes written so far to the OS (a reader of the file sees them)."""
        self._fh.flush()

    def finish(self) -> tuple[int, str]:
        """Close the file (fsynced); returns its size and sha256."""
        if self._pos != len(self._expected):
            raise RuntimeFailure(
                f"internal error: shard {self.path.name} closed before tensor {self.current!r} was complete"
            )
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        return self._size, self._hash.hexdigest()

    def abort(self) -> None:
        """Discard a shard in flight."""
        try:
            self._fh.close()
        finally:
            self.path.unlink(missing_ok=True)


def file_sha256(path: Path, chunk: int = 16 * 1024 * 1024) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            block = fh.read(chunk)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


class OutputStage:
    """The staging directory of one run: journal, shards, side files, final rename."""

    def __init__(self, out: Path, fingerprint: str, *, resume: bool | None) -> None:
        self.out = Path(out).expanduser().absolute()
        self.dir = staging_dir(self.out)
        self.fingerprint = fingerprint
        self.done: dict[str, ShardRecord] = {}
        self.resumed: list[str] = []  # shards verified and kept from an interrupted run
        self._open(resume)

    def _open(self, resume: bool | None) -> None:
        journal = self.dir / JOURNAL
        if self.dir.exists():
            same = False
            records: list[dict] = []
            try:
                lines = journal.read_text(encoding="utf-8").splitlines()
                head = json.loads(lines[0]) if lines else {}
                same = head.get("fingerprint") == self.fingerprint
                for line in lines[1:]:
                    try:
                        records.append(json.loads(line))
                    except ValueError:
                        break  # a torn last line: that shard is redone
            except (OSError, ValueError, IndexError):
                same = False
            if resume is True and not same:
                raise InputError(
                    f"--resume: the partial output {self.dir} was made by a different command or "
                    "different inputs; remove it or rerun without --resume"
                )
            if same and resume is not False:
                for rec in records:
                    path = self.dir / rec["name"]
                    if (
                        path.exists()
                        and path.stat().st_size == rec["size"]
                        and file_sha256(path) == rec["sha256"]
                    ):
                        self.done[rec["name"]] = ShardRecord(**rec)
                self.resumed = sorted(self.done)
                self._rewrite_journal()
                return
            shutil.rmtree(self.dir)
        elif resume is True:
            raise InputError(f"--resume: no partial output found at {self.dir}")
        self.dir.mkdir(parents=True)
        self._rewrite_journal()

    def _rewrite_journal(self) -> None:
        lines = [json.dumps({"fingerprint": self.fingerprint})]
        lines += [json.dumps(rec.__dict__) for rec in self.done.values()]
        write_text_atomic(self.dir / JOURNAL, "".join(line + "\n" for line in lines), fsync=True)

    def shard_writer(self, name: str, entries, metadata) -> ShardWriter:
        return ShardWriter(self.dir / name, entries, metadata)

    def record(self, rec: ShardRecord) -> None:
        """Journal a finished shard (one appended line, fsynced)."""
        self.done[rec.name] = rec
        with open(self.dir / JOURNAL, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(rec.__dict__) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def write_json(self, name: str, doc: object) -> Path:
        path = self.dir / name
        path.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        return path

    def write_text(self, name: str, text: str) -> Path:
        path = self.dir / name
        path.write_text(text, encoding="utf-8")
        return path

    def copy_side_files(self, source_dir: Path, weight_names: set[str]) -> list[str]:
        """Copy the fine-tune's config, generation config, tokenizer and chat template files."""
        copied = []
        root = allowed_root(Path(source_dir))
        for p in sorted(Path(source_dir).iterdir()):
            name = p.name
            if (
                name in weight_names
                or name in SIDE_FILE_SKIP
                or name.endswith(".safetensors.index.json")
                or not name.endswith(SIDE_FILE_SUFFIXES)
                or not side_file_ok(p, root)
            ):
                continue
            shutil.copyfile(p, self.dir / name)
            copied.append(name)
        return copied

    def finalize(self, *, overwrite: bool) -> Path:
        """Remove the journal and move the staging directory to OUT atomically."""
        (self.dir / JOURNAL).unlink(missing_ok=True)
        return swap_dir_into_place(self.dir, self.out, overwrite=overwrite, during="running")

    def discard(self) -> None:
        """Remove the staging directory (bad input found before any work worth keeping)."""
        shutil.rmtree(self.dir, ignore_errors=True)
