"""Reading checkpoints: one place that finds, validates and streams a model's tensors.

A :class:`Checkpoint` is a directory with a single ``*.safetensors`` file or shards listed by a
``*.safetensors.index.json``. Opening it parses and validates every shard header up front (a
bad tensor deep in the last shard fails in the first second), refuses pickles, and refuses
index entries or symlinks that point outside the checkpoint.

Tensors are read one at a time with ``pread`` into buffers the caller owns; no shard is kept
memory-mapped, so the process's resident memory is the tensors in flight and never the model
(a reader that maps shards shows every touched page in RSS). Row ranges of a 2-D tensor can be
read on their own, so tall matrices (embeddings) are streamed in blocks.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dghard_cli.errors import InputError
from dghard_cli.io import files
from dghard_cli.io.safetensors_format import DTYPES, FLOAT_DTYPES, ShardHeader, parse_header, torch_dtype

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
#: JSON files read by the tool (index, config) larger than this are refused.
MAX_JSON_BYTES = 64 * 1024 * 1024
_CHUNK = 64 * 1024 * 1024

CONVERT_HINT = (
    "dghard never unpickles checkpoints; convert to safetensors first, e.g. "
    '`python -c "from transformers import AutoModelForCausalLM as M; '
    "M.from_pretrained('DIR').save_pretrained('DIR-st', safe_serialization=True)\"`"
)


class _DescriptorPool:
    """At most :meth:`limit` shard descriptors open at a time, across every checkpoint.

    A merge of thousands of models has more shards than the process may hold open (``ulimit
    -n``). Readers open their descriptor on use and register it here; past the limit the least
    recently used *idle* one is closed (a reader in the middle of a read is never touched) and
    is opened again, re-checked, on its next read. Reads stay ``pread`` calls.
    """

    #: descriptors left for everything else (the interpreter, torch, the output, the journal)
    RESERVED = 48
    MOST = 256

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: OrderedDict[FileReader, None] = OrderedDict()  # least recently used first
        self._limit: int | None = None

    def limit(self) -> int:
        if self._limit is None:
            import resource

            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            room = self.MOST if soft == resource.RLIM_INFINITY else (soft - self.RESERVED) // 2
            self._limit = max(2, min(self.MOST, room))
        return self._limit

    def used(self, reader: FileReader) -> list[FileReader]:
        """Mark ``reader`` as most recently used (its descriptor open); the idle readers to close."""
        with self.lock:
            self.open[reader] = None
            self.open.move_to_end(reader)
            excess = len(self.open) - self.limit()
            victims = []
            for r in list(self.open):
                if excess <= 0:
                    break
                if r is not reader and r.busy == 0:
                    del self.open[r]
                    victims.append(r)
                    excess -= 1
            return victims

    def forget(self, reader: FileReader) -> None:
        with self.lock:
            self.open.pop(reader, None)


POOL = _DescriptorPool()


class FileReader:
    """Positional reads from one shard file; the descriptor is opened on use and may be closed
    between reads by the descriptor pool (:data:`POOL`), then opened again and checked to be the
    same file.

    ``os.preadv`` into caller-owned buffers: thread-safe (no shared file position) and no
    mapping, so only the buffers count towards resident memory.
    """

    def __init__(self, path: Path, roots: Sequence[Path] | None = None, size: int | None = None) -> None:
        self.path = path
        self.roots = roots
        self.size = size  # the size seen when the header was validated
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the first open
        self.busy = 0  # reads in flight (guarded by _lock): never closed by the pool meanwhile

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other

    def _acquire(self) -> int:
        with self._lock:
            if self._fd is None:
                f = files.open_input(self.path, what="shard", roots=self.roots)
                st = os.fstat(f.fd)
                if self.size is not None and f.size != self.size:
                    f.close()
                    raise InputError(
                        f"{self.path}: shard changed size ({self.size} -> {f.size} bytes) while dghard "
                        "was running; rerun on a checkpoint nothing else writes to"
                    )
                if self._identity is not None and self._identity != (st.st_dev, st.st_ino):
                    f.close()
                    raise InputError(
                        f"{self.path}: shard was replaced by another file while dghard was running; "
                        "rerun on a checkpoint nothing else writes to"
                    )
                self._identity = (st.st_dev, st.st_ino)
                self._fd = f.detach()
            self.busy += 1
            fd = self._fd
        for victim in POOL.used(self):
            victim._close_if_idle()
        return fd

    def _release(self) -> None:
        with self._lock:
            self.busy -= 1

    def _close_if_idle(self) -> None:
        with self._lock:
            if self.busy == 0 and self._fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._fd)
                self._fd = None
                return
        with POOL.lock:  # became busy again meanwhile: it stays open, and is counted again
            POOL.open[self] = None

    def read_into(self, view: memoryview, offset: int, what: str) -> None:
        fd = self._acquire()
        try:
            done, total = 0, view.nbytes
            while done < total:
                n = os.preadv(fd, [view[done : done + _CHUNK]], offset + done)
                if n <= 0:
                    raise InputError(f"{self.path}: file ended while reading {what} (truncated?)")
                done += n
        finally:
            self._release()

    def close(self) -> None:
        POOL.forget(self)
        with self._lock:
            if self._fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._fd)
                self._fd = None


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives and what it is, from a validated header."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: str
    file: Path
    offset: int  # absolute byte offset of the tensor's data in ``file``
    nbytes: int
    reader: FileReader = field(compare=False, repr=False, default=None)  # type: ignore[assignment]

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes

    def read_raw(self, rows: tuple[int, int] | None = None, *, pin: bool = False) -> torch.Tensor:
        """The raw bytes of the tensor (or rows ``[r0, r1)``) as a new uint8 CPU tensor.

        ``pin``: into page-locked memory, so a CUDA copy from it is asynchronous and fast.
        """
        if rows is None:
            start, nbytes = 0, self.nbytes
        else:
            start, nbytes = rows[0] * self.row_bytes, (rows[1] - rows[0]) * self.row_bytes
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        if nbytes:
            self.reader.read_into(memoryview(buf.numpy()), self.offset + start, f"tensor {self.name!r}")
        return buf

    def read_raw_span(self, span: tuple[int, int], *, pin: bool = False) -> torch.Tensor:
        """The raw bytes of elements ``[e0, e1)`` of the flattened tensor (row-major order):
        a 1×N matrix or a long vector is streamed in pieces this way, as rows cannot split it."""
        e0, e1 = span
        size = self.itemsize
        buf = torch.empty((e1 - e0) * size, dtype=torch.uint8, pin_memory=pin)
        if buf.numel():
            self.reader.read_into(memoryview(buf.numpy()), self.offset + e0 * size, f"tensor {self.name!r}")
        return buf

    def decode(self, raw: torch.Tensor, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """View raw bytes (as read by :meth:`read_raw`) as the tensor's dtype and shape."""
        shape = self.shape if rows is None else (rows[1] - rows[0], *self.shape[1:])
        return raw.view(torch_dtype(self.dtype)).reshape(shape)

    def read(self, rows: tuple[int, int] | None = None, *, pin: bool = False) -> torch.Tensor:
        """The tensor (or rows ``[r0, r1)`` of its first dimension) as a new CPU tensor."""
        return self.decode(self.read_raw(rows, pin=pin), rows)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][0]

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES


def read_json_file(
    path: Path, what: str, limit: int = MAX_JSON_BYTES, roots: Sequence[Path] | None = None
) -> object:
    """Read a small JSON file through :mod:`dghard_cli.io.files` (a regular file inside
    ``roots``, size-, depth- and element-limited); InputError naming the file otherwise."""
    return files.read_json(path, what=what, limit=limit, roots=roots)


def path_exists(path: Path) -> bool:
    """``path.exists()``, but a path the system cannot even look up (a name longer than the
    filesystem allows, say) is a one-line input error rather than a crash."""
    try:
        return path.exists()
    except OSError as exc:
        raise InputError(f"{str(path)[:200]}: cannot be looked up ({exc.strerror})") from None


def allowed_root(directory: Path) -> tuple[Path, ...]:
    """Where files of this checkpoint may resolve to (:func:`dghard_cli.io.files.input_roots`).

    The directory itself; for a Hugging Face cache snapshot (``.../snapshots/<rev>``), whose
    files are symlinks into ``../../blobs``, also the cache's blob store.
    """
    return files.input_roots(directory)


def _safe_member(directory: Path, name: object, root: Path | Sequence[Path], what: str) -> Path:
    """A file named in an index: a plain file name inside the directory, no escape."""
    if (
        not isinstance(name, str)
        or not name
        or "\x00" in name
        or "/" in name
        or "\\" in name
        or name in (".", "..")
        or os.path.isabs(name)
    ):
        raise InputError(
            f"{what} names shard {name!r}, which is not a plain file name inside the checkpoint "
            "directory; refusing to read outside it"
        )
    path = directory / name
    roots = (root,) if isinstance(root, Path) else tuple(root)
    real = files.realpath(path)
    if not any(files.is_within(real, r) for r in roots):
        raise InputError(
            f"{what}: shard {name!r} is a symlink that resolves outside the checkpoint "
            f"directory ({real}); refusing to read it"
        )
    return path


class Checkpoint:
    """A validated safetensors checkpoint directory (single file or sharded)."""

    def __init__(
        self,
        path: Path,
        *,
        label: str = "checkpoint",
        source: str | None = None,
        revision: str | None = None,
    ) -> None:
        self.path = Path(path)
        self.label = label
        self.source = source if source is not None else str(path)
        self.revision = revision
        self.index_file: str | None = None
        self.shards: list[str] = []
        self.shard_metadata: dict[str, dict[str, str]] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._readers: dict[str, FileReader] = {}
        self.roots: tuple[Path, ...] = allowed_root(self.path)
        self._discover()

    # -- discovery and validation ---------------------------------------------------------
    def _discover(self) -> None:
        d = self.path
        if not path_exists(d):
            raise InputError(f"{self.label} {d}: no such directory")
        if not d.is_dir():
            raise InputError(f"{self.label} {d}: is a file; pass the checkpoint directory that holds it")
        try:
            names = sorted(p.name for p in d.iterdir())
        except OSError as exc:
            raise InputError(f"{self.label} {d}: cannot list directory ({exc.strerror})") from None
        root = self.roots = allowed_root(d)
        indexes = [n for n in names if n.endswith(".safetensors.index.json")]
        singles = [n for n in names if n.endswith(".safetensors")]
        if "model.safetensors.index.json" in indexes:
            indexes = ["model.safetensors.index.json"]
        if len(indexes) > 1:
            raise InputError(
                f"{self.label} {d}: several safetensors indexes ({', '.join(indexes)}); "
                "keep one per directory"
            )
        if indexes:
            self.index_file = indexes[0]
            weight_map = self._read_index(d / indexes[0])
            shard_order: list[str] = []
            for shard in weight_map.values():
                if shard not in shard_order:
                    shard_order.append(shard)
            self.shards = sorted(shard_order)
            for shard in self.shards:
                self._load_shard(_safe_member(d, shard, root, f"{d / indexes[0]}"), shard)
            missing = [n for n, s in weight_map.items() if self.tensors.get(n) is None]
            wrong = [n for n, s in weight_map.items() if n in self.tensors and self.tensors[n].shard != s]
            if missing:
                raise InputError(
                    f"{d / indexes[0]}: tensor {missing[0]!r} is listed in shard "
                    f"{weight_map[missing[0]]!r} but that shard does not contain it"
                )
            if wrong:
                raise InputError(
                    f"{d / indexes[0]}: tensor {wrong[0]!r} is listed in shard "
                    f"{weight_map[wrong[0]]!r} but stored in {self.tensors[wrong[0]].shard!r}"
                )
            unlisted = [n for n in self.tensors if n not in weight_map]
            if unlisted:
                raise InputError(
                    f"{d / indexes[0]}: shard {self.tensors[unlisted[0]].shard!r} holds tensor "
                    f"{unlisted[0]!r} that the index does not list; the index is stale"
                )
        elif singles:
            if "model.safetensors" in singles:
                singles = ["model.safetensors"]
            if len(singles) > 1:
                raise InputError(
                    f"{self.label} {d}: {len(singles)} .safetensors files and no "
                    "model.safetensors.index.json; add the index or keep one file"
                )
            self.shards = singles
            self._load_shard(_safe_member(d, singles[0], root, str(d)), singles[0])
        else:
            pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
            if pickles:
                raise InputError(
                    f"{self.label} {d}: only pickle weights ({pickles[0]}) found", hint=CONVERT_HINT
                )
            if not names:
                raise InputError(f"{self.label} {d}: directory is empty; no checkpoint there")
            raise InputError(f"{self.label} {d}: no .safetensors weights found")
        if not self.tensors:
            raise InputError(f"{self.label} {d}: its safetensors files hold no tensors; nothing to read")
        # order tensors by shard, then by position in the file
        self.tensors = dict(sorted(self.tensors.items(), key=lambda kv: (kv[1].shard, kv[1].offset)))

    def _read_index(self, path: Path) -> dict[str, str]:
        doc = read_json_file(path, "safetensors index", roots=self.roots)
        if not isinstance(doc, dict) or not isinstance(doc.get("weight_map"), dict):
            raise InputError(f"{path}: index has no 'weight_map' object")
        weight_map = doc["weight_map"]
        if not weight_map:
            raise InputError(f"{path}: index 'weight_map' is empty")
        for name, shard in weight_map.items():
            if not isinstance(shard, str):
                raise InputError(f"{path}: tensor {name!r} maps to {shard!r}, not a file name")
        return weight_map

    def _load_shard(self, path: Path, shard: str) -> None:
        where = str(path)
        if not os.path.lexists(path):
            raise InputError(f"{where}: shard listed in the index is missing")
        try:
            with files.open_input(path, what="shard", roots=self.roots) as fh:
                size = fh.size
                prefix = fh.read(8)
                header: ShardHeader = parse_header(prefix, fh.read, size, where)
        except OSError as exc:
            raise InputError(f"{where}: cannot read ({exc.strerror})") from None
        self.shard_metadata[shard] = header.metadata
        reader = self._readers.setdefault(shard, FileReader(path, self.roots, size))
        for e in header.entries:
            if e.name in self.tensors:
                raise InputError(
                    f"{where}: tensor {e.name!r} is also stored in shard "
                    f"{self.tensors[e.name].shard!r}; duplicate tensor names across shards"
                )
            self.tensors[e.name] = TensorInfo(
                name=e.name,
                dtype=e.dtype,
                shape=e.shape,
                shard=shard,
                file=path,
                offset=header.data_start + e.begin,
                nbytes=e.nbytes,
                reader=reader,
            )

    # -- metadata -------------------------------------------------------------------------
    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def config(self) -> dict | None:
        """``config.json`` parsed (size-limited), or None if absent."""
        path = self.path / "config.json"
        if not os.path.lexists(path):
            return None
        doc = read_json_file(path, "config.json", limit=files.CONFIG_LIMIT, roots=self.roots)
        if not isinstance(doc, dict):
            raise InputError(f"{path}: config.json is not a JSON object")
        return doc

    def describe(self) -> dict:
        """What the report records about this input."""
        return {
            "source": self.source,
            "path": str(self.path),
            "revision": self.revision,
            "shards": len(self.shards),
            "tensors": len(self.tensors),
            "bytes": self.total_bytes,
        }

    # -- reading ------------------------------------------------------------------------
    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Read a tensor (or rows ``[r0, r1)`` of its first dimension) into a new CPU tensor."""
        return self.tensors[name].read(rows)

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def row_ranges(info: TensorInfo, chunk_bytes: int) -> list[tuple[int, int] | None]:
    """Row ranges that split a tensor into pieces of about ``chunk_bytes`` (None: whole)."""
    if not info.shape or info.nbytes <= chunk_bytes or info.shape[0] <= 1:
        return [None]
    step = max(1, chunk_bytes // max(1, info.row_bytes))
    return [(r0, min(r0 + step, info.shape[0])) for r0 in range(0, info.shape[0], step)]
