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

import contextlib
import hashlib
import json
import os
import re
import shutil
import weakref
from dataclasses import dataclass
from pathlib import Path

from dghard_cli.errors import InputError, RuntimeFailure
from dghard_cli.io import files
from dghard_cli.io.atomic import swap_dir_into_place, write_text_atomic
from dghard_cli.io.checkpoint import path_exists
from dghard_cli.io.lock import OutLock
from dghard_cli.io.report_json import json_text
from dghard_cli.io.safetensors_format import build_header

JOURNAL = "dghard_journal.jsonl"
STAGING_SUFFIX = ".dghard-partial"
INDEX_NAME = "model.safetensors.index.json"

#: Files copied from the fine-tune next to the weights (configs, tokenizer, chat template).
SIDE_FILE_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken", ".py")
SIDE_FILE_SKIP = {"dghard_report.json", "sweep_report.json", "README.md"}
#: Side files a merge of several fine-tunes takes from FT #1: what every input shares (the
#: architecture's config, generation settings, tokenizer and chat template, remote code). Any
#: other side file (training arguments, trainer state, evaluation results, notes) describes FT #1
#: alone, and a merge is not FT #1: it is left out (a repair, or a merge of one fine-tune, keeps it).
SHARED_SIDE_FILE = re.compile(
    r"^(config\.json|generation_config\.json|preprocessor_config\.json|tokenizer.*|special_tokens_map\.json"
    r"|added_tokens\.json|chat_template.*|vocab.*|merges.*|.*\.model|.*\.tiktoken|.*\.py)$"
)
#: Largest side file read as text (the fine-tune's README.md); side files copied are copied in full.
SIDE_FILE_MAX = 64 * 1024 * 1024
#: Room left free on OUT's filesystem beyond the bytes to write (metadata, journal, reports).
FREE_SPACE_MARGIN = 64 * 1024 * 1024


def read_side_text(directory: Path, name: str) -> tuple[str | None, str | None]:
    """``(text, None)`` of the UTF-8 side file ``name`` of an input directory (the fine-tune's
    model card), read through :mod:`dghard_cli.io.files`: a regular file inside the input's
    roots, at most :data:`SIDE_FILE_MAX` bytes; ``(None, why)`` when it is absent or may not be
    read (a link out of the input, a FIFO, a directory: never read, the run goes on)."""
    path = Path(directory) / name
    try:
        if not os.path.lexists(path):
            return None, "absent"
    except OSError:
        return None, "absent"
    try:
        data = files.read_bytes(path, what=name, limit=SIDE_FILE_MAX, roots=files.input_roots(directory))
    except InputError:
        return None, (
            f"not read: not a regular file inside {directory}, or larger than {SIDE_FILE_MAX} bytes"
        )
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError:
        return None, "not read: not UTF-8 text"


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
    margin = FREE_SPACE_MARGIN
    if free < needed + margin:
        raise InputError(
            f"output {out}: needs {_fmt_bytes(needed + margin)} free ({_fmt_bytes(needed)} to write plus "
            f"a {_fmt_bytes(margin)} safety margin) but {parent} has {_fmt_bytes(free)} free; "
            "free space or choose another OUT"
        )


def _fmt_bytes(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"  # pragma: no cover


def list_side_files(
    source_dir: Path, weight_names: set[str], roots: tuple[Path, ...] | None = None
) -> list[tuple[str, int]]:
    """The fine-tune's side files to copy (config, tokenizer, chat template …) and their sizes.

    Each is checked as every input is (:func:`dghard_cli.io.files.check_input_file`): a symlink
    out of the checkpoint, a FIFO, a device or a directory under a side file's name is an
    InputError, before anything is written. Sizes are unlimited: side files are copied in full.
    ``roots`` None: the directory's own (:func:`dghard_cli.io.files.input_roots`).
    """
    if roots is None:
        roots = files.input_roots(source_dir)
    out = []
    try:
        entries = sorted(Path(source_dir).iterdir())
    except OSError as exc:
        raise InputError(f"{source_dir}: cannot list directory ({exc.strerror})") from None
    for p in entries:
        name = p.name
        if (
            name in weight_names
            or name in SIDE_FILE_SKIP
            or name.endswith(".safetensors.index.json")
            or not name.endswith(SIDE_FILE_SUFFIXES)
        ):
            continue
        st = files.check_input_file(p, what=f"side file {name}", roots=roots)
        out.append((name, st.st_size))
    return out


def split_side_files(
    sources: list[tuple[Path, set[str]]], several: bool
) -> tuple[list[tuple[Path, set[str]]], list[tuple[str, Path]]]:
    """``(sources, left out)``: for a merge of several fine-tunes (``several``) the side files
    that describe one model alone (not :data:`SHARED_SIDE_FILE`) are added to each source's skip
    set and listed as ``(name, directory)``; otherwise the sources unchanged and nothing left out."""
    if not several:
        return sources, []
    kept, left_out = [], []
    for d, skip in sources:
        names = [n for n, _ in list_side_files(d, skip) if not SHARED_SIDE_FILE.match(n)]
        left_out += [(n, Path(d)) for n in names]
        kept.append((d, set(skip) | set(names)))
    return kept, left_out


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
        path.unlink(missing_ok=True)  # never write through whatever was left at this name
        self._fh = open(path, "xb")  # noqa: SIM115 - closed in finish/abort
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
        if mv.nbytes == 0:  # a zero-size tensor (already skipped in the layout) or an empty block
            return
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
        # one run per OUT (before the staging directory is looked at, let alone replaced); the
        # lock goes with finalize()/discard(), or with this object when a failure drops it
        self.lock = OutLock(self.out).acquire()
        weakref.finalize(self, self.lock.release)
        try:
            self._open(resume)
        except BaseException:
            self.lock.release()
            raise

    def _open(self, resume: bool | None) -> None:
        journal = self.dir / JOURNAL
        if self.dir.exists():
            same = False
            records: list[dict] = []
            try:
                text = files.read_text(
                    journal, what="journal", limit=files.JSON_LIMIT, roots=(files.realpath(self.dir),)
                )
                lines = text.splitlines()
                head = json.loads(lines[0]) if lines else {}
                same = head.get("fingerprint") == self.fingerprint
                for line in lines[1:]:
                    try:
                        records.append(json.loads(line))
                    except ValueError:
                        break  # a torn last line: that shard is redone
            except (OSError, ValueError, IndexError, AttributeError, InputError):
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

    def write_failed(self, path: Path, what: str, exc: OSError) -> RuntimeFailure:
        """The one mapping of a failed write into the stage (side files, index, model card,
        report): exit 3 naming the file, the stage kept for the rerun, OUT's lock released."""
        self.lock.release()
        return files.write_error(path, what, exc, kept_in=self.dir)

    def write_json(self, name: str, doc: object) -> Path:
        path = self.dir / name
        try:
            path.write_text(json_text(doc, ensure_ascii=False), encoding="utf-8")
        except OSError as exc:
            raise self.write_failed(path, name, exc) from None
        return path

    def write_text(self, name: str, text: str) -> Path:
        path = self.dir / name
        try:
            path.parent.mkdir(parents=True, exist_ok=True)  # --report OUT/sub/report.json
            path.write_text(text, encoding="utf-8")
        except OSError as exc:
            raise self.write_failed(path, name, exc) from None
        return path

    def copy_side_files(
        self, source_dir: Path, weight_names: set[str], roots: tuple[Path, ...] | None = None
    ) -> list[str]:
        """Copy the fine-tune's config, generation config, tokenizer and chat template files,
        each in full, through the file-access layer (OSError while writing propagates)."""
        copied = []
        roots = roots if roots is not None else files.input_roots(source_dir)
        for name, _ in list_side_files(source_dir, weight_names, roots):
            dest = self.dir / name
            try:
                dest.unlink(missing_ok=True)  # a resumed run may have copied it already
                files.copy_input(Path(source_dir) / name, dest, what=f"side file {name}", roots=roots)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    dest.unlink(missing_ok=True)  # nothing half-written is left
                raise self.write_failed(dest, f"side file {name}", exc) from None
            copied.append(name)
        return copied

    def finalize(self, *, overwrite: bool) -> Path:
        """Remove the journal and move the staging directory to OUT atomically."""
        (self.dir / JOURNAL).unlink(missing_ok=True)
        out = swap_dir_into_place(self.dir, self.out, overwrite=overwrite, during="running")
        self.lock.release()
        return out

    def discard(self) -> None:
        """Remove the staging directory (bad input found before any work worth keeping)."""
        shutil.rmtree(self.dir, ignore_errors=True)
        self.lock.release()
