"""The safetensors file format: validated header parsing and header building.

This module is pure: bytes in, plain data out. It never trusts a header: every field is
checked before anything is allocated or read, so a hostile or corrupt file fails with a
one-line :class:`InputError` naming the file and what is wrong, and never makes the tool
read outside the file or allocate memory in proportion to a number written in it.

Layout of a file: 8 bytes little-endian u64 ``N``, ``N`` bytes of UTF-8 JSON (the header,
padded with spaces), then the data buffer. The header maps tensor names to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the buffer) and may
hold ``"__metadata__"``: a string-to-string map.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field

import torch

from dghard_cli.errors import InputError
from dghard_cli.io.limits import parse_json

#: Largest header the official library accepts (100 MB); larger is refused before reading.
MAX_HEADER_BYTES = 100_000_000

#: safetensors dtype name -> (bytes per element, the torch dtype's name: an attribute of torch
#: that a given torch build may lack, e.g. the float8 and unsigned types). Names, not dtypes, so
#: that reading this table (headers, sizes) does not import torch.
DTYPES: dict[str, tuple[int, str]] = {
    "BOOL": (1, "bool"),
    "U8": (1, "uint8"),
    "I8": (1, "int8"),
    "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E5M2": (1, "float8_e5m2"),
    "F8_E8M0": (1, "float8_e8m0fnu"),
    "I16": (2, "int16"),
    "U16": (2, "uint16"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "I32": (4, "int32"),
    "U32": (4, "uint32"),
    "F32": (4, "float32"),
    "I64": (8, "int64"),
    "U64": (8, "uint64"),
    "F64": (8, "float64"),
}

#: Floating dtypes a spectral method or merge may read and write.
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})

#: Unit roundoff (half the spacing of numbers near 1) of each floating dtype.
UNIT_ROUNDOFF = {"F16": 2.0**-11, "BF16": 2.0**-8, "F32": 2.0**-24, "F64": 2.0**-53}

#: Names users type for ``--dtype`` -> safetensors dtype.
DTYPE_ALIASES = {
    "bf16": "BF16",
    "bfloat16": "BF16",
    "fp16": "F16",
    "float16": "F16",
    "half": "F16",
    "fp32": "F32",
    "float32": "F32",
    "float": "F32",
    "fp64": "F64",
    "float64": "F64",
}


def torch_dtype(st_dtype: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name (raises InputError if torch lacks it)."""
    entry = DTYPES.get(st_dtype)
    dtype = getattr(torch, entry[1], None) if entry is not None else None
    if not isinstance(dtype, torch.dtype):
        raise InputError(f"dtype {st_dtype} cannot be decoded by this torch build")
    return dtype


def parse_dtype_option(value: str) -> str:
    """Map a user's ``--dtype`` value (bf16, fp16, fp32, ...) to a safetensors dtype name."""
    key = value.strip().lower()
    if key in DTYPE_ALIASES:
        return DTYPE_ALIASES[key]
    if value.upper() in FLOAT_DTYPES:
        return value.upper()
    raise InputError(f"--dtype {value!r} is not one of bf16, fp16, fp32, fp64")


def dtype_flag(dtype: str) -> str:
    """The ``--dtype`` spelling of a safetensors dtype name (BF16 -> bf16, F32 -> fp32), the
    inverse of :func:`parse_dtype_option`."""
    return next((k for k in ("bf16", "fp16", "fp32", "fp64") if DTYPE_ALIASES[k] == dtype), dtype)


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor as a header describes it; offsets are relative to the data buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class ShardHeader:
    """A parsed, validated header: entries in data order, metadata, and where data starts."""

    entries: list[HeaderEntry]
    metadata: dict[str, str] = field(default_factory=dict)
    data_start: int = 0
    data_len: int = 0


def _reject_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_header(prefix: bytes, header_bytes_reader, file_size: int, where: str) -> ShardHeader:
    """Parse and validate a safetensors header.

    ``prefix`` is the file's first 8 bytes; ``header_bytes_reader(n)`` returns the next ``n``
    bytes (called only after ``n`` has been checked against the file size). ``where`` names
    the file in error messages.
    """
    if file_size < 8 or len(prefix) < 8:
        raise InputError(f"{where}: not a safetensors file (shorter than 8 bytes; truncated?)")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise InputError(
            f"{where}: header length {n} bytes is absurd (limit {MAX_HEADER_BYTES}); "
            "the file is corrupt or not safetensors"
        )
    if n > file_size - 8:
        raise InputError(
            f"{where}: header length {n} bytes is larger than the file ({file_size} bytes); "
            "the file is truncated or corrupt"
        )
    raw = header_bytes_reader(n)
    if len(raw) != n:
        raise InputError(f"{where}: file ended inside the header (truncated)")
    # bounded: a header nests three levels; deeper is corrupt (and would exhaust the stack)
    doc = parse_json(
        raw, f"{where}: header", max_depth=8, max_elements=16_000_000, object_pairs_hook=_reject_duplicates
    )
    if not isinstance(doc, dict):
        raise InputError(f"{where}: header is not a JSON object; the file is corrupt")

    data_start = 8 + n
    data_len = file_size - data_start
    metadata: dict[str, str] = {}
    entries: list[HeaderEntry] = []
    for name, spec in doc.items():
        if name == "__metadata__":
            if spec is None:  # null: no metadata (the reference safetensors library opens these)
                continue
            if not isinstance(spec, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in spec.items()
            ):
                raise InputError(f"{where}: __metadata__ must map strings to strings")
            metadata = dict(spec)
            continue
        if not name:
            raise InputError(f"{where}: a tensor has an empty name")
        if not isinstance(spec, dict):
            raise InputError(f"{where}: tensor {name!r} entry is not an object")
        dtype = spec.get("dtype")
        shape = spec.get("shape")
        offsets = spec.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise InputError(f"{where}: tensor {name!r} has unknown dtype {dtype!r}")
        if (
            not isinstance(shape, list)
            or len(shape) > 16
            or not all(_is_int(d) and 0 <= d < 2**62 for d in shape)
        ):
            raise InputError(f"{where}: tensor {name!r} has an invalid shape {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_int(o) and o >= 0 for o in offsets)
            or offsets[0] > offsets[1]
        ):
            raise InputError(f"{where}: tensor {name!r} has invalid data_offsets {offsets!r}")
        begin, end = offsets
        if end > data_len:
            raise InputError(
                f"{where}: tensor {name!r} data_offsets [{begin}, {end}] run past the end of "
                f"the file (data is {data_len} bytes; truncated?)"
            )
        nbytes = math.prod(shape) * DTYPES[dtype][0]
        if nbytes != end - begin:
            raise InputError(
                f"{where}: tensor {name!r} shape {shape} x {dtype} is {nbytes} bytes but its "
                f"data_offsets span {end - begin}"
            )
        if math.prod(d for d in shape if d) * DTYPES[dtype][0] >= 2**63:
            # a zero dimension makes the byte count 0, but no array library can hold the others
            raise InputError(
                f"{where}: tensor {name!r} has shape {shape!r}, whose element count overflows "
                "(the non-zero dimensions multiply past 2^63 bytes)"
            )
        entries.append(HeaderEntry(name, dtype, tuple(shape), begin, end))

    entries.sort(key=lambda e: (e.begin, e.end))
    cursor = 0
    for e in entries:
        if e.begin != cursor:
            what = "overlap" if e.begin < cursor else "leave a gap before"
            raise InputError(
                f"{where}: tensor {e.name!r} data_offsets {e.begin}..{e.end} {what} the "
                "previous tensor; the file is corrupt"
            )
        cursor = e.end
    if cursor != data_len:
        raise InputError(
            f"{where}: tensors cover {cursor} bytes but the data buffer is {data_len} bytes; "
            "the file is corrupt"
        )
    return ShardHeader(entries=entries, metadata=metadata, data_start=data_start, data_len=data_len)


def build_header(
    entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> tuple[bytes, list[tuple[int, int]]]:
    """Header bytes (length prefix included) for tensors written in the given order.

    Returns the bytes to write before the data and each tensor's ``(begin, end)`` offsets.
    """
    doc: dict[str, object] = {}
    if metadata:
        doc["__metadata__"] = dict(metadata)
    offsets = []
    cursor = 0
    for name, dtype, shape in entries:
        nbytes = math.prod(shape) * DTYPES[dtype][0]
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [cursor, cursor + nbytes]}
        offsets.append((cursor, cursor + nbytes))
        cursor += nbytes
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body, offsets


def tensor_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of this dtype and shape takes in a file."""
    return math.prod(shape) * DTYPES[dtype][0]
