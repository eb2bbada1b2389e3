"""Layer-wise strengths (LiNeS, Wang et al., ICLR 2025, arXiv 2410.17146) on top of any method.

Every scheduled tensor becomes ``W = W_base + λ(ℓ)·(W_method − W_base)``: the update the method
would write (Δ for a plain schedule, Δ* of DG-Hard or a shrinker, the merged task vector of a
merge) scaled by the strength of the tensor's layer. Two forms:

- ``--lines A,B``: ``λ(ℓ) = A + B·ℓ/(L−1)`` for block ℓ = 0 … L−1; the embeddings take the
  shallowest strength (A) and the final norm and head the deepest (A + B). With a single block
  (L = 1) the block sits midway, λ = A + B/2.
- ``--layer-strengths 'embed=0.2,0-7=0.3,8-15=0.6,16-23=0.9,head=1'`` (or a YAML file of the
  same mapping): one strength per group; the embeddings, the head and every block must be
  covered exactly once.

Which tensors: every tensor of a block (norms and biases included) takes its block's λ, so under
a schedule the 1-D, small and ≥3-D tensors that the spectral methods leave at the fine-tune's
value become ``W_base + λ·Δ`` (action ``scaled``). Tensors only in the fine-tune, non-floating
tensors and tensors left out by ``--include``/``--exclude`` keep the fine-tune's value; rows a
fine-tune added to a resized vocabulary keep the fine-tune's values (the shared rows are
scheduled); tied embeddings are one parameter and take the embeddings' λ.

Precision: the wrapped method writes its result in float64, the schedule is applied in float64
(``b + λ·(w − b)``), and the result is cast to the output dtype once.

Layer depth comes from the tensor names and config.json (:mod:`dghard_cli.architecture`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from dghard_cli.architecture import (
    EMBED,
    HEAD,
    VOCAB_EMBEDDING,
    ModelDepth,
    Place,
    format_ranges,
    model_depth,
    place_depth,
    tensor_place,
)
from dghard_cli.architecture import unknown_place_message as _unknown
from dghard_cli.engine.ops import JobInputs, TensorOp, cast_out, element_spans, passthrough
from dghard_cli.engine.plan import Eligibility, Plan, PolicyOptions, TensorJob
from dghard_cli.errors import InputError, RuntimeFailure
from dghard_cli.io.checkpoint import Checkpoint
from dghard_cli.io.safetensors_format import FLOAT_DTYPES

#: A group of the per-group form: ``"embed"``, ``"head"`` or an inclusive block range.
GroupKey = str | tuple[int, int]

#: The dtype the wrapped method writes in (the schedule is applied before the one final cast).
WIDE = "F64"
#: Row pieces of the schedule's own float64 temporaries.
CHUNK_BYTES = 32 * 1024 * 1024
MAX_STRENGTHS_FILE_BYTES = 1024 * 1024
#: Actions the schedule scales: the method's tensors and, under a schedule, the rest of the
#: floating tensors the spectral methods would pass through (norms, biases, small, ≥3-D).
SCALABLE_REASONS = ("1-d", "small", "vector")


# -- the schedule as given -----------------------------------------------------------------------


def _number(text: str, what: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise InputError(f"{what}: {text.strip()!r} is not a number") from None
    if not math.isfinite(v):
        raise InputError(f"{what}: strengths must be finite, got {text.strip()!r}")
    return v


def _fmt(v: float) -> str:
    return repr(float(v))


def _key_text(key: GroupKey) -> str:
    if isinstance(key, str):
        return key
    lo, hi = key
    return str(lo) if lo == hi else f"{lo}-{hi}"


@dataclass(frozen=True)
class LayerSchedule:
    """A schedule as the user gave it (not yet bound to a model's number of layers)."""

    alpha: float | None = None  # --lines A,B
    beta: float | None = None
    groups: tuple[tuple[GroupKey, float], ...] = ()  # --layer-strengths, in the order given
    option: str = "--lines"  # what the user wrote it with (for messages)

    def __post_init__(self) -> None:
        linear = self.alpha is not None or self.beta is not None
        if linear == bool(self.groups):
            raise InputError("give either --lines A,B or --layer-strengths, not both")
        if linear:
            for v in (self.alpha, self.beta):
                if v is None or isinstance(v, bool) or not math.isfinite(float(v)):
                    raise InputError(
                        f"--lines needs two finite numbers A,B, got {self.alpha!r},{self.beta!r}"
                    )

    @property
    def form(self) -> str:
        return "lines" if self.alpha is not None else "groups"

    @property
    def spec(self) -> str:
        """The canonical command-line value (``0.2,0.6`` or ``embed=0.2,0-7=0.3,...``)."""
        if self.form == "lines":
            return f"{_fmt(self.alpha)},{_fmt(self.beta)}"  # type: ignore[arg-type]
        return ",".join(f"{_key_text(k)}={_fmt(v)}" for k, v in self.groups)

    def argv(self) -> list[str]:
        """The command-line arguments that give this schedule."""
        from dghard_cli.methods.declare import LAYER_STRENGTHS, LINES

        return [(LINES if self.form == "lines" else LAYER_STRENGTHS).cli_flag, self.spec]

    def describe(self) -> dict:
        """For the report's ``parameters`` (and the run's fingerprint)."""
        if self.form == "lines":
            return {"lines": [float(self.alpha), float(self.beta)]}  # type: ignore[arg-type]
        return {"layer_strengths": self.spec}

    def resolve(self, depth: ModelDepth) -> Strengths:
        """Per-layer strengths for a model of ``depth.num_layers`` blocks (coverage checked)."""
        n = depth.num_layers
        if self.form == "lines":
            a, b = float(self.alpha), float(self.beta)  # type: ignore[arg-type]
            layers = tuple(a + b * place_depth(i, n) for i in range(n))
            return Strengths(embed=a, layers=layers, head=a + b, depth=depth, schedule=self)
        return _resolve_groups(self, depth)


def parse_lines(text: str) -> LayerSchedule:
    """``--lines A,B`` -> a schedule."""
    parts = [p for p in str(text).split(",")]
    if len(parts) != 2 or not all(p.strip() for p in parts):
        raise InputError(
            f"--lines {text!r}: expected two numbers A,B (λ = A at the embeddings and the first block, "
            "A + B at the last block and the head), e.g. --lines 0.2,0.6"
        )
    return LayerSchedule(alpha=_number(parts[0], "--lines"), beta=_number(parts[1], "--lines"))


_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def _group_key(raw: object, what: str) -> GroupKey:
    if isinstance(raw, bool):
        raise InputError(f"{what}: {raw!r} is not a group (embed, head, N or N-M)")
    if isinstance(raw, int):
        if raw < 0:
            raise InputError(f"{what}: block {raw} is negative")
        return (raw, raw)
    text = str(raw).strip()
    low = text.lower()
    if low in ("embed", "embeddings"):
        return EMBED
    if low == "head":
        return HEAD
    m = _RANGE.match(text)
    if not m:
        raise InputError(
            f"{what}: {text!r} is not a group: use embed, head, a block N or a block range N-M "
            "(e.g. embed=0.2,0-7=0.3,8-15=0.6,head=1)"
        )
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) is not None else lo
    if hi < lo:
        raise InputError(f"{what}: block range {text!r} runs backwards (write {hi}-{lo})")
    return (lo, hi)


def _strength_value(raw: object, what: str) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise InputError(f"{what}: the strength must be a number, got {raw!r}")
    return _number(str(raw), what)


def _groups(items: list[tuple[object, object]], what: str) -> LayerSchedule:
    if not items:
        raise InputError(f"{what}: no strengths given (e.g. embed=0.2,0-7=0.3,8-15=0.6,head=1)")
    out: list[tuple[GroupKey, float]] = []
    seen: set[str] = set()
    for raw_key, raw_val in items:
        key = _group_key(raw_key, what)
        at = f"{what}: {_key_text(key)}"
        val = _strength_value(raw_val, at)
        if isinstance(key, str):
            if key in seen:
                raise InputError(f"{what}: {key} is given twice")
            seen.add(key)
        out.append((key, val))
    return LayerSchedule(groups=tuple(out), option="--layer-strengths")


def parse_layer_strengths(text: str) -> LayerSchedule:
    """``embed=0.2,0-7=0.3,…,head=1`` (or the path of a YAML file holding that mapping)."""
    text = str(text)
    if "=" not in text:
        path = Path(text).expanduser()
        if not os.path.lexists(path):  # a FIFO or device there: the file layer says so
            raise InputError(
                f"--layer-strengths {text!r}: no such file, and not GROUP=STRENGTH items "
                "(e.g. embed=0.2,0-7=0.3,8-15=0.6,head=1)"
            )
        return load_layer_strengths(path)
    what = "--layer-strengths"
    items: list[tuple[object, object]] = []
    for part in text.split(","):
        if not part.strip():
            raise InputError(f"{what} {text!r}: an empty item (two commas in a row?)")
        if part.count("=") != 1:
            raise InputError(f"{what}: {part.strip()!r} is not GROUP=STRENGTH (e.g. 0-7=0.3)")
        k, v = part.split("=")
        items.append((k, v))
    return _groups(items, what)


def layer_strengths_from_mapping(doc: object, what: str) -> LayerSchedule:
    """A mapping ``{embed: 0.2, "0-7": 0.3, …, head: 1}`` (YAML file, recipe key)."""
    if isinstance(doc, Mapping) and set(doc) == {"layer_strengths"}:
        doc = doc["layer_strengths"]
    if isinstance(doc, str):
        return parse_layer_strengths(doc) if "=" in doc else _groups([], what)
    if not isinstance(doc, Mapping):
        raise InputError(
            f"{what}: expected a mapping of group: strength (embed: 0.2, 0-7: 0.3, ..., head: 1), "
            f"got {type(doc).__name__}"
        )
    return _groups(list(doc.items()), what)


def load_layer_strengths(path: Path) -> LayerSchedule:
    from dghard_cli.methods.recipe import read_yaml_file

    what = f"--layer-strengths {path}"
    doc = read_yaml_file(path, what, MAX_STRENGTHS_FILE_BYTES)
    return layer_strengths_from_mapping(doc, what)


def schedule_from_options(lines: str | None, layer_strengths: str | None) -> LayerSchedule | None:
    """The command line's ``--lines`` / ``--layer-strengths`` (at most one of them)."""
    if lines is not None and layer_strengths is not None:
        raise InputError("give either --lines A,B or --layer-strengths, not both")
    if lines is not None:
        return parse_lines(lines)
    if layer_strengths is not None:
        return parse_layer_strengths(layer_strengths)
    return None


def lines_value(value: object) -> LayerSchedule:
    """``--lines`` from the command line ("A,B") or a recipe's ``lines:`` ("A,B" or [A, B])."""
    if isinstance(value, list):
        if len(value) != 2 or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value):
            raise InputError("'lines' must be two numbers [A, B] or the string 'A,B'")
        return LayerSchedule(alpha=float(value[0]), beta=float(value[1]))
    if not isinstance(value, str):
        raise InputError("'lines' must be two numbers [A, B] or the string 'A,B'")
    return parse_lines(value)


def layer_strengths_value(value: object) -> LayerSchedule:
    """``--layer-strengths`` from the command line (items or a YAML file) or a recipe's
    ``layer_strengths:`` (a mapping, items, or a YAML file)."""
    if isinstance(value, str):
        return parse_layer_strengths(value)
    return layer_strengths_from_mapping(value, "layer_strengths")


def schedule_from_recipe(values: Mapping, where: str) -> LayerSchedule | None:
    """A merge recipe's ``lines:`` ("A,B" or [A, B]) or ``layer_strengths:`` key."""
    lines, groups = values.get("lines"), values.get("layer_strengths")
    if lines is not None and groups is not None:
        raise InputError(f"{where}: give either 'lines' or 'layer_strengths', not both")
    try:
        if lines is not None:
            return lines_value(lines)
        if groups is not None:
            return layer_strengths_value(groups)
    except InputError as exc:
        raise InputError(f"{where}: {exc}") from None
    return None


def _resolve_groups(schedule: LayerSchedule, depth: ModelDepth) -> Strengths:
    n = depth.num_layers
    what = "--layer-strengths"
    owner: dict[int, str] = {}
    embed = head = None
    for key, val in schedule.groups:
        if key == EMBED:
            embed = val
            continue
        if key == HEAD:
            head = val
            continue
        lo, hi = key  # type: ignore[misc]
        if hi >= n:
            raise InputError(
                f"{what}: block {'range ' if lo != hi else ''}{_key_text(key)} goes past the last block "
                f"{n - 1} (the model has {n} blocks: {depth.source})"
            )
        for i in range(lo, hi + 1):
            if i in owner:
                raise InputError(
                    f"{what}: block {i} is covered twice ({owner[i]} and {_key_text(key)}); "
                    "give every block exactly once"
                )
            owner[i] = _key_text(key)
    if embed is None:
        raise InputError(f"{what}: no strength for the embeddings (add embed=X)")
    if head is None:
        raise InputError(f"{what}: no strength for the final norm and head (add head=X)")
    gaps = [i for i in range(n) if i not in owner]
    if gaps:
        raise InputError(
            f"{what}: block{'s' if len(gaps) > 1 else ''} {format_ranges(gaps)} "
            f"{'are' if len(gaps) > 1 else 'is'} not covered (the model has {n} blocks, 0-{n - 1}); "
            "give every block exactly once"
        )
    values = dict(schedule.groups)
    layers = []
    for i in range(n):
        key = next(k for k in values if not isinstance(k, str) and k[0] <= i <= k[1])
        layers.append(values[key])
    return Strengths(embed=embed, layers=tuple(layers), head=head, depth=depth, schedule=schedule)


# -- bound to a model ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Strengths:
    """λ for every place of one model: the embeddings, each block, the head."""

    embed: float
    layers: tuple[float, ...]
    head: float
    depth: ModelDepth
    schedule: LayerSchedule

    def at(self, place: Place) -> float:
        if place == EMBED:
            return self.embed
        if place == HEAD:
            return self.head
        return self.layers[int(place)]

    def for_tensor(self, name: str) -> tuple[Place, float]:
        place = tensor_place(name)
        if place is None:
            raise InputError(_unknown(name))
        if isinstance(place, int) and not 0 <= place < self.depth.num_layers:
            raise InputError(
                f"tensor {name!r} is in block {place}, but the model has {self.depth.num_layers} blocks"
            )
        return place, self.at(place)

    def line(self) -> str:
        """The compact per-layer line of the terminal summary (equal neighbours merged)."""
        parts = [f"embed {_short(self.embed)}"]
        i, n = 0, len(self.layers)
        blocks = []
        while i < n:
            j = i
            while j + 1 < n and self.layers[j + 1] == self.layers[i]:
                j += 1
            blocks.append(f"{i if i == j else f'{i}-{j}'}: {_short(self.layers[i])}")
            i = j + 1
        parts.append(", ".join(blocks))
        parts.append(f"head {_short(self.head)}")
        return " | ".join(parts)

    def report(self) -> dict:
        """The report's ``layer_strengths`` section."""
        doc: dict = {"form": self.schedule.form}
        if self.schedule.form == "lines":
            doc["alpha"], doc["beta"] = float(self.schedule.alpha), float(self.schedule.beta)  # type: ignore[arg-type]
            doc["formula"] = "lambda(l) = alpha + beta * l / (L - 1); embed: alpha; head: alpha + beta"
        doc.update(
            {
                "option": self.schedule.argv(),
                "num_layers": self.depth.num_layers,
                "num_layers_from": self.depth.source,
                "stack": self.depth.stack,
                "embed": self.embed,
                "layers": list(self.layers),
                "head": self.head,
                "summary": self.line(),
            }
        )
        return doc


def _short(v: float) -> str:
    return f"{v:.4g}"


def checkpoint_depth(ck: Checkpoint) -> ModelDepth:
    """The layer stack of a checkpoint (names and config.json must agree)."""
    return model_depth(ck.tensors, ck.config(), where=f"{ck.label} ({ck.source})")


def schedule_problem(base: Checkpoint, ft: Checkpoint) -> str | None:
    """Why a schedule cannot be bound to this pair with the default policy (None: it can):
    the layer stack cannot be read, or a floating tensor of both has no known place."""
    try:
        depth = checkpoint_depth(ft)
        for name, info in ft.tensors.items():
            b = base.tensors.get(name)
            if b is None or info.dtype not in FLOAT_DTYPES or b.dtype not in FLOAT_DTYPES:
                continue
            place = tensor_place(name)
            if place is None:
                return _unknown(name)
            if isinstance(place, int) and not 0 <= place < depth.num_layers:
                return f"tensor {name!r} is in block {place}, but the model has {depth.num_layers} blocks"
    except InputError as exc:
        return str(exc)
    return None


def scheduled_eligibility(policy: PolicyOptions) -> Eligibility:
    """A plain schedule (no spectral method): every selected floating tensor is scaled."""

    def eligible(name: str, info) -> str | None:
        if info.dtype not in FLOAT_DTYPES:
            return "non-float"
        if not policy.selected(name):
            return "excluded"
        return None

    return eligible


def _scalable(job: TensorJob) -> bool:
    """A tensor the method passes through that the schedule scales instead (norms, biases, …)."""
    if job.action != "kept-ft" or job.base is None or not job.fts:
        return False
    if job.base.dtype not in FLOAT_DTYPES or any(f.dtype not in FLOAT_DTYPES for f in job.fts):
        return False
    reason = job.reason or ""
    return reason in SCALABLE_REASONS or bool(re.fullmatch(r"\d+-d", reason))


def bind(schedule: LayerSchedule, plan: Plan, ft: Checkpoint) -> Strengths:
    """Resolve ``schedule`` for FT's layer stack and annotate the plan's jobs with their λ.

    Raises InputError (nothing written yet) for an unreadable depth or a bad per-group form.
    """
    strengths = schedule.resolve(checkpoint_depth(ft))
    jobs = {j.name: j for j in plan.jobs}
    for job in plan.jobs:
        if _scalable(job):
            job.action = "scaled"
            assert job.base is not None
            if job.base.shape != job.shape:  # a resized vocabulary too small for the method
                job.shared_rows = min(job.base.shape[0], job.shape[0])
        if job.action in ("method", "resized", "scaled"):
            job.layer, job.strength = strengths.for_tensor(job.name)
    for job in plan.jobs:
        if job.action == "tied" and job.tied_to is not None:
            first = jobs[job.tied_to]
            if first.strength is None:
                continue
            # one parameter, one strength: the input embedding's
            embed_name = job.name if VOCAB_EMBEDDING.search(job.name) else first.name
            first.layer, first.strength = strengths.for_tensor(embed_name)
            job.layer, job.strength = first.layer, first.strength
    return strengths


def strength_fields(job: TensorJob) -> dict:
    """Per-tensor report fields of a scheduled job (empty for the others)."""
    if job.strength is None:
        return {}
    return {"layer": job.layer, "layer_strength": job.strength}


# -- the wrapper ---------------------------------------------------------------------------------


def _all_finite(job: TensorJob, src: JobInputs) -> bool:
    keys = ["base", *[f"ft{i}" for i in range(len(job.fts))]]
    for key in keys:
        info = src.info(key)
        if info.dtype not in FLOAT_DTYPES:
            continue
        for span in element_spans(info.numel, info.itemsize, CHUNK_BYTES):
            t = src.flat(key, span)
            if not bool(torch.isfinite(t).all()):
                return False
    return True


def _wide(block: torch.Tensor) -> torch.Tensor:
    """A block the wrapped method wrote in float64 (raw bytes when it passed one through), flat:
    blocks may be row ranges or pieces of the flattened tensor (a 1×N matrix, a long vector)."""
    if block.dtype == torch.uint8:
        block = block.contiguous().clone().view(torch.float64)
    if block.dtype != torch.float64:
        block = block.to(torch.float64)
    return block.reshape(-1)


class ScheduledOp:
    """``W_base + λ(ℓ)·(W_op − W_base)`` for every scheduled job; ``inner`` None: ``W_op = W_ft``."""

    def __init__(self, inner: TensorOp | None, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.inner = inner
        self.chunk_bytes = chunk_bytes

    def __call__(self, job: TensorJob, src: JobInputs, rec: dict) -> Iterator[torch.Tensor]:
        lam = job.strength
        if lam is None:  # not scheduled (cannot happen for a bound plan's method jobs)
            yield from (self.inner or passthrough)(job, src, rec)
            return
        if src.allow_nonfinite and not _all_finite(job, src):
            rec["action"], rec["reason"], rec["nonfinite"] = "kept-ft", "nonfinite", True
            rec.pop("layer_strength", None)
            yield from passthrough(job, src, rec)
            return
        wide_job = dataclasses.replace(job, out_dtype=WIDE)
        op = passthrough if (self.inner is None or job.action == "scaled") else self.inner
        scaled_rows = job.shared_rows if job.shared_rows is not None else (job.shape[0] if job.shape else 1)
        row_elems = math.prod(job.shape[1:]) if len(job.shape) >= 1 else 1
        scaled = scaled_rows * row_elems  # the scheduled elements come first in row-major order
        step = max(1, self.chunk_bytes // 8)
        e = 0
        for block in op(wide_job, src, rec):
            w = _wide(block)
            k = w.numel()
            for i in range(0, k, step):
                piece = w[i : i + step]
                e0, e1 = e + i, e + i + piece.numel()
                n_sched = max(0, min(e1, scaled) - e0)
                if n_sched:
                    b = src.flat("base", (e0, e0 + n_sched)).to(torch.float64)
                    yield self._scale(job, piece[:n_sched], b, lam)
                if n_sched < piece.numel():  # rows the fine-tune added: its values
                    yield cast_out(piece[n_sched:], job.out_dtype)
            e += k

    @staticmethod
    def _scale(job: TensorJob, w: torch.Tensor, b: torch.Tensor, lam: float) -> torch.Tensor:
        out = torch.sub(w, b).mul_(lam).add_(b)
        if not bool(torch.isfinite(out).all()):
            raise InputError(
                f"tensor {job.name!r}: BASE or the fine-tune holds NaN or Inf; fix the checkpoint, "
                "or pass --allow-nonfinite to keep such tensors as they are"
            )
        if job.out_dtype == "F16" and float(out.abs().max()) > 65504.0:
            raise RuntimeFailure(
                f"tensor {job.name!r}: the scheduled values exceed float16's range; use --dtype bf16 or fp32"
            )
        return cast_out(out, job.out_dtype)


def wrap(inner: Callable[[torch.device], TensorOp | None]) -> Callable[[torch.device], TensorOp]:
    """``make_op`` for the runner: the method's operation (or none) under the schedule."""
    return lambda device: ScheduledOp(inner(device))
