"""The tensor policy: what happens to every tensor, and where its output goes.

Built from headers only (a dry run reads nothing else). Per name in the fine-tune(s):

- 2-D floating tensor with ``>= min_numel`` elements, present in BASE with equal shape, selected
  by ``--include``/``--exclude`` -> the method;
- 1-D, small, ≥3-D, non-float or excluded tensors -> the fine-tune's value (``kept-ft``);
- names only in the fine-tune -> kept (``kept-ft``, reason ``ft-only``);
- names only in BASE -> an error, or with ``allow_missing`` the base value (``kept-base``);
- embeddings / lm_head whose vocabulary the fine-tune resized -> the method on the shared
  rows, new rows from the fine-tune (``resized``); any other shape mismatch -> an error;
- several fine-tunes whose vocabularies differ: allowed when fine-tune #1 added rows and each
  other one kept BASE's rows or has exactly #1's (the shared rows are merged, the new rows are
  #1's); otherwise an error saying why (new tokens of different vocabularies cannot be merged);
- tied embeddings (``tie_word_embeddings``) are computed once; the tied twin is a copy
  (``tied``).

The output layout mirrors the (first) fine-tune's shards unless ``shard_size`` is given.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from dghard_cli.architecture import OUTPUT_HEAD, VOCAB_EMBEDDING, is_vocab_matrix
from dghard_cli.errors import InputError
from dghard_cli.io.checkpoint import Checkpoint, TensorInfo
from dghard_cli.io.safetensors_format import FLOAT_DTYPES, tensor_nbytes


@dataclass
class TensorJob:
    """One output tensor: its action, its inputs, where it is written."""

    name: str
    action: str  # method | kept-ft | kept-base | resized | tied | scaled
    reason: str | None
    shape: tuple[int, ...]
    out_dtype: str
    shard: str = ""
    base: TensorInfo | None = None
    fts: list[TensorInfo] = field(default_factory=list)
    shared_rows: int | None = None
    tied_to: str | None = None
    layer: str | int | None = None  # under a layer-strength schedule: "embed", block index, "head"
    strength: float | None = None  # ... and its λ (see dghard_cli/schedule/)
    #: The dtype finally written when ``out_dtype`` is a wide intermediate (a schedule asks the method for
    #: float64 before its own single cast); None: ``out_dtype`` is what is written.
    final_dtype: str | None = None

    @property
    def out_nbytes(self) -> int:
        return tensor_nbytes(self.out_dtype, self.shape)

    @property
    def in_nbytes(self) -> int:
        n = sum(t.nbytes for t in self.fts)
        return n + (self.base.nbytes if self.base is not None else 0)

    @property
    def runs_method(self) -> bool:
        return self.action in ("method", "resized", "scaled")  # scaled: W_base + λ·Δ (a schedule)

    @property
    def untouched(self) -> bool:
        """Every fine-tune's tensor is BASE's own (a module no LoRA adapter adapts): every merge
        gives BASE back."""
        return self.base is not None and bool(self.fts) and all(f is self.base for f in self.fts)


@dataclass
class Plan:
    jobs: list[TensorJob]
    shards: dict[str, list[str]]  # output shard -> tensor names, in write order
    write_index: bool
    notes: list[str] = field(default_factory=list)

    @property
    def out_bytes(self) -> int:
        return sum(j.out_nbytes for j in self.jobs)


@dataclass
class PolicyOptions:
    min_numel: int = 1024
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    allow_missing: bool = False
    out_dtype: str | None = None  # safetensors dtype for floating outputs; None = the fine-tune's
    shard_size: int | None = None  # bytes; None = mirror the fine-tune's shards

    def __post_init__(self) -> None:
        if self.min_numel < 0:
            raise InputError("--min-numel must be >= 0")
        self._inc = [_compile(p, "--include") for p in self.include]
        self._exc = [_compile(p, "--exclude") for p in self.exclude]
        if self.shard_size is not None and self.shard_size <= 0:
            raise InputError("--shard-size must be positive")

    def selected(self, name: str) -> bool:
        if self._inc and not any(p.search(name) for p in self._inc):
            return False
        return not any(p.search(name) for p in self._exc)


def _compile(pattern: str, option: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise InputError(f"{option} {pattern!r} is not a valid regular expression ({exc})") from None


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``2GiB``, ``1000000`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgGtT]i?[bB]?|[bB])?\s*", text)
    if not m:
        raise InputError(f"size {text!r} is not like 5GB, 500MB or a number of bytes")
    value = float(m.group(1))
    unit = (m.group(2) or "b").lower().rstrip("b")
    mult = {
        "": 1,
        "k": 10**3,
        "m": 10**6,
        "g": 10**9,
        "t": 10**12,
        "ki": 2**10,
        "mi": 2**20,
        "gi": 2**30,
        "ti": 2**40,
    }[unit]
    size = int(value * mult)
    if size <= 0:
        raise InputError(f"size {text!r} must be positive")
    return size


#: ``eligible(name, info) -> reason or None``: None means the method applies.
Eligibility = Callable[[str, TensorInfo], str | None]


def matrix_eligibility(opts: PolicyOptions) -> Eligibility:
    """Repair's rule: 2-D floating matrices of at least ``min_numel`` elements."""

    def eligible(name: str, info: TensorInfo) -> str | None:
        if info.dtype not in FLOAT_DTYPES:
            return "non-float"
        if len(info.shape) == 1 or len(info.shape) == 0:
            return "1-d"
        if len(info.shape) >= 3:
            return f"{len(info.shape)}-d"
        if not opts.selected(name):
            return "excluded"
        if info.numel < opts.min_numel:
            return "small"
        if min(info.shape) < 2:
            return "vector"
        return None

    return eligible


def _out_dtype(info: TensorInfo, opts: PolicyOptions) -> str:
    if opts.out_dtype and info.dtype in FLOAT_DTYPES:
        return opts.out_dtype
    # a computed tensor (an adapter's W_base + ΔW, float32) defaults to the dtype BASE stores
    return getattr(info, "output_dtype", None) or info.dtype


def build_plan(
    base: Checkpoint,
    fts: list[Checkpoint],
    opts: PolicyOptions,
    *,
    eligible: Eligibility | None = None,
    tie_embeddings: bool | None = None,
) -> Plan:
    """The per-tensor plan for BASE and one or more fine-tunes of it (headers only)."""
    if not fts:
        raise InputError("no fine-tuned checkpoint given")
    eligible = eligible or matrix_eligibility(opts)
    ft0 = fts[0]
    notes: list[str] = []
    for k, other in enumerate(fts[1:], start=2):
        for name in ft0.tensors:
            t = other.tensors.get(name)
            if (
                t is not None
                and t.shape != ft0.tensors[name].shape
                and _vocab_rows_differ(name, base, ft0, t)
            ):
                _check_vocab_rows(
                    name, base.tensors[name].shape[0], ft0.tensors[name].shape[0], t.shape[0], k
                )
                notes.append(
                    f"{name}: fine-tune #{k} keeps BASE's {t.shape[0]} rows; the shared rows are merged, "
                    "the rows fine-tune #1 added come from #1"
                )
                continue
            if t is None or t.shape != ft0.tensors[name].shape:
                what = "missing" if t is None else f"shape {list(t.shape)} vs {list(ft0.tensors[name].shape)}"
                raise InputError(
                    f"fine-tune #{k} ({other.source}) differs from #1 ({ft0.source}) at tensor "
                    f"{name!r} ({what}); merged models must share one architecture"
                )
        extra = [n for n in other.tensors if n not in ft0.tensors]
        if extra:
            raise InputError(
                f"fine-tune #{k} ({other.source}) has tensor {extra[0]!r} that #1 ({ft0.source}) lacks; "
                "merged models must share one architecture"
            )

    base_only = [n for n in base.tensors if n not in ft0.tensors]
    if base_only and not opts.allow_missing:
        raise InputError(
            f"tensor {base_only[0]!r} is in BASE ({base.source}) but not in the fine-tune "
            f"({ft0.source}){f' (and {len(base_only) - 1} more)' if len(base_only) > 1 else ''}; "
            "pass --allow-missing to keep the base values"
        )

    jobs: list[TensorJob] = []
    for name, info in ft0.tensors.items():
        infos = [f.tensors[name] for f in fts]
        b = base.tensors.get(name)
        out_dtype = _out_dtype(info, opts)
        if b is None:
            jobs.append(TensorJob(name, "kept-ft", "ft-only", info.shape, out_dtype, info.shard, None, infos))
            continue
        # a zero-size tensor (0×N, length 0) has nothing to filter or merge: written as it is
        reason = "empty" if info.numel == 0 else eligible(name, info)
        if b.shape != info.shape:
            resizable = (
                len(b.shape) == 2
                and len(info.shape) == 2
                and b.shape[1] == info.shape[1]
                and is_vocab_matrix(name)
            )
            if not resizable:
                raise InputError(
                    f"tensor {name!r} has shape {list(b.shape)} in BASE but {list(info.shape)} in "
                    f"the fine-tune ({ft0.source}); only embedding/lm_head rows may differ"
                )
            shared = min(b.shape[0], info.shape[0])
            if reason is None and shared >= 2 and shared * info.shape[1] >= opts.min_numel:
                jobs.append(
                    TensorJob(
                        name, "resized", None, info.shape, out_dtype, info.shard, b, infos, shared_rows=shared
                    )
                )
            else:
                jobs.append(
                    TensorJob(name, "kept-ft", reason or "small", info.shape, out_dtype, info.shard, b, infos)
                )
            notes.append(
                f"{name}: vocabulary resized {b.shape[0]} -> {info.shape[0]} rows; "
                f"method on the {shared} shared rows, new rows from the fine-tune"
            )
            continue
        if b.dtype not in FLOAT_DTYPES and reason is None:
            reason = "non-float"
        action = "method" if reason is None else "kept-ft"
        jobs.append(TensorJob(name, action, reason, info.shape, out_dtype, info.shard, b, infos))

    last_shard = jobs[-1].shard if jobs else ft0.shards[-1]
    for name in base_only:
        b = base.tensors[name]
        jobs.append(
            TensorJob(name, "kept-base", "base-only", b.shape, _out_dtype(b, opts), last_shard, b, [])
        )
    if base_only:
        notes.append(f"{len(base_only)} tensors only in BASE kept with their base values (--allow-missing)")

    empty = [j.name for j in jobs if j.reason == "empty"]
    if empty:
        notes.append(
            f"{len(empty)} zero-size tensor(s) written as they are (reason 'empty'), e.g. {empty[0]!r}"
        )
    _tie(jobs, ft0, tie_embeddings, notes)
    shards, write_index = _layout(jobs, ft0, opts)
    return Plan(jobs=jobs, shards=shards, write_index=write_index, notes=notes)


def _vocab_rows_differ(name: str, base: Checkpoint, ft0: Checkpoint, other: TensorInfo) -> bool:
    """An embedding/lm_head whose row count differs between fine-tunes (columns equal, in BASE too)."""
    b, f0 = base.tensors.get(name), ft0.tensors[name]
    return (
        b is not None
        and is_vocab_matrix(name)
        and len(b.shape) == len(f0.shape) == len(other.shape) == 2
        and b.shape[1] == f0.shape[1] == other.shape[1]
    )


def _check_vocab_rows(name: str, base_rows: int, first_rows: int, rows: int, k: int) -> None:
    """Fine-tunes with different vocabulary sizes: the rows shared with BASE are merged and the
    rows beyond BASE come from fine-tune #1, so #1 must be the one that added rows and every
    other fine-tune must have BASE's rows (or exactly #1's: then #1's new rows win)."""
    if rows == base_rows and first_rows > base_rows:
        return
    if rows > base_rows and first_rows == base_rows:
        raise InputError(
            f"tensor {name!r}: fine-tune #{k} adds rows ({base_rows} -> {rows}) and fine-tune #1 does not; "
            f"list #{k} first: the rows beyond BASE and the output's config and tokenizer come from fine-tune #1"
        )
    if rows > base_rows and first_rows > base_rows:
        raise InputError(
            f"tensor {name!r}: fine-tunes #1 and #{k} both add rows beyond BASE's {base_rows} ({first_rows} vs "
            f"{rows}); new tokens of different vocabularies cannot be merged: resize them to one vocabulary first"
        )
    raise InputError(
        f"tensor {name!r}: fine-tune #1 has {first_rows} rows, #{k} {rows}, BASE {base_rows}; fine-tunes may "
        "differ only in rows that fine-tune #1 added beyond BASE (the others keeping BASE's rows)"
    )


def _tie(jobs: list[TensorJob], ft0: Checkpoint, tie: bool | None, notes: list[str]) -> None:
    if tie is None:
        cfg = ft0.config() or {}
        tie = bool(cfg.get("tie_word_embeddings", False))
        text_cfg = cfg.get("text_config")
        if isinstance(text_cfg, dict) and "tie_word_embeddings" in text_cfg:
            tie = tie or bool(text_cfg["tie_word_embeddings"])
    if not tie:
        return
    ins = [j for j in jobs if VOCAB_EMBEDDING.search(j.name)]
    outs = [j for j in jobs if OUTPUT_HEAD.search(j.name)]
    for a in ins:
        for b in outs:
            if (
                a.shape == b.shape
                and a.fts[0].dtype == b.fts[0].dtype
                and a.out_dtype == b.out_dtype
                and b.tied_to is None
                and a.tied_to is None
            ):
                first, second = (a, b) if jobs.index(a) < jobs.index(b) else (b, a)
                second.action, second.reason, second.tied_to = "tied", "tied-embeddings", first.name
                notes.append(f"{second.name} is tied to {first.name}: computed once, written twice")
                return


def _layout(jobs: list[TensorJob], ft0: Checkpoint, opts: PolicyOptions) -> tuple[dict[str, list[str]], bool]:
    if opts.shard_size is None:
        shards: dict[str, list[str]] = {}
        for j in jobs:
            shards.setdefault(j.shard, []).append(j.name)
        return dict(sorted(shards.items())), ft0.index_file is not None
    groups: list[list[TensorJob]] = [[]]
    size = 0
    for j in jobs:
        if groups[-1] and size + j.out_nbytes > opts.shard_size:
            groups.append([])
            size = 0
        groups[-1].append(j)
        size += j.out_nbytes
    if len(groups) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    shards = {}
    for shard_name, group in zip(names, groups, strict=True):
        for j in group:
            j.shard = shard_name
        shards[shard_name] = [j.name for j in group]
    return shards, len(groups) > 1
