"""The layer-strength schedule as the user gives it: ``--lines A,B``, ``--layer-strengths``
items or a YAML file of them, a recipe's ``lines:`` / ``layer_strengths:`` keys.

Holds :class:`LayerSchedule` (the schedule before it meets a model), its parsers, and the
per-group coverage check that turns it into :class:`Strengths` (λ for every place) for a
model's layer stack. Relies on :mod:`dghard_cli.architecture` for the group names and block
depth; :mod:`dghard_cli.schedule` describes the schedule itself.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dghard_cli.architecture import EMBED, HEAD, ModelDepth, Place, format_ranges, place_depth, tensor_place
from dghard_cli.architecture import unknown_place_message as _unknown
from dghard_cli.errors import InputError
from dghard_cli.numbers import flag_value

#: A group of the per-group form: ``"embed"``, ``"head"`` or an inclusive block range.
GroupKey = str | tuple[int, int]

MAX_STRENGTHS_FILE_BYTES = 1024 * 1024

#: The two spellings on the command line (the ``lines`` and ``layer_strengths`` parameters of
#: :mod:`dghard_cli.methods.declare`).
LINES_FLAG, LAYER_STRENGTHS_FLAG = "--lines", "--layer-strengths"

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
    return flag_value(float(v))


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
        return [LINES_FLAG if self.form == "lines" else LAYER_STRENGTHS_FLAG, self.spec]

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
    # here, not at the top: the file reader loads torch (io.checkpoint), declaring the parameter does not
    from dghard_cli.io.yaml_file import read_yaml_file

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


# -- the schedule for one layer stack ---------------------------------------------------------------


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
