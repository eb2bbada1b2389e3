"""The candidates of the ``lines`` sweep family: the entry and candidate types, the per-group
block ranges and the ``--layer-strengths`` schedule of a per-group point, a candidate at an
(α, β) pair or a :class:`GroupPoint`. Its options (so its command and its writing) are the
family's: :mod:`dghard_cli.sweeping.families.lines`.

Relies on :mod:`dghard_cli.sweeping.candidates` (the family-independent candidate types and number
formatting) and :mod:`dghard_cli.schedule.spec` (``LayerSchedule``).
:mod:`dghard_cli.sweeping.lines` is the public entry and describes the family's search.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dghard_cli.architecture import place_depth
from dghard_cli.errors import InputError
from dghard_cli.schedule.spec import LayerSchedule
from dghard_cli.spectral.spectrum import ShrinkSpec
from dghard_cli.sweeping.candidates import Candidate, FamilyEntry, _fmt, round_sig

FAMILY = "lines"
DEFAULT_RANGE = {"alpha": (0.0, 1.0), "beta": (0.0, 1.0)}
DEFAULT_STEP = 0.1
DEFAULT_GROUPS = 4
DEFAULT_GROUP_RANGE = (-0.5, 0.5)
#: Digits of a per-group candidate's strengths (the schedule it writes: readable commands).
STRENGTH_DIGITS = 6


@dataclass(frozen=True)
class GroupPoint:
    """A per-group candidate: the best (α, β) of the first stage plus one offset per group."""

    base: tuple[float, float]
    offsets: tuple[float, ...]  # embeddings, each block range, head


@dataclass
class LinesEntry(FamilyEntry):
    """A ``lines`` entry of the candidate file (``grid`` holds (α, β) pairs)."""

    alpha_range: tuple[float, float] = DEFAULT_RANGE["alpha"]
    beta_range: tuple[float, float] = DEFAULT_RANGE["beta"]
    step: float = DEFAULT_STEP
    groups: int = DEFAULT_GROUPS
    group_range: tuple[float, float] = DEFAULT_GROUP_RANGE
    refine_groups: bool = False  # dghard sweep --refine groups
    num_layers: int | None = None  # bound from FT when the sweep opens its inputs
    grid_pairs: list[tuple[float, float]] = field(default_factory=list)
    #: a merge under the schedule (sweeping/merges.py follow-up): the merge candidate's parameters,
    #: to which each point adds ``lines``; None: ``dghard repair --lines``
    merge_params: tuple | None = None

    def describe(self) -> dict:
        if self.merge_params is not None:
            p = dict(self.merge_params)
            return {
                "index": self.index,
                "family": self.family,
                "command": "merge",
                "axis": "alpha,beta",
                "grid": [list(q) for q in self.grid_pairs],
                "range": {"alpha": list(self.alpha_range), "beta": list(self.beta_range)},
                "step": self.step,
                "tolerance": self.tolerance,
                "refine": self.refine,
                "fixed": {k: list(v) if isinstance(v, tuple) else v for k, v in p.items()},
                "fine_tunes": "several",
                "origin": self.origin,
            }
        return {
            "index": self.index,
            "family": self.family,
            "command": "repair",
            "axis": "alpha,beta",
            "grid": [list(p) for p in self.grid_pairs],
            "range": {"alpha": list(self.alpha_range), "beta": list(self.beta_range)},
            "step": self.step,
            "tolerance": self.tolerance,
            "refine": self.refine,
            "fixed": dict(self.fixed),
            "fine_tunes": "one",
            "refine_groups": self.refine_groups,
            "groups": self.groups,
            "group_range": list(self.group_range),
            "num_layers": self.num_layers,
        }


@dataclass(frozen=True)
class LinesCandidate(Candidate):
    @property
    def label(self) -> str:
        p = dict(self.params)
        a, b = p["lines"] if "lines" in p else p["lines_base"]
        text = f"lines {_fmt(a)},{_fmt(b)}"
        if "offsets" in p:
            moved = [
                f"{name}{'+' if d > 0 else ''}{_fmt(d)}"
                for name, d in zip(p["group_names"], p["offsets"], strict=True)
                if d != 0
            ]
            text += f" groups({', '.join(moved)})"
        if "shrink" in p:
            extra = [f"scale={_fmt(p['scale'])}"]
            extra += [f"{k}={_fmt(p[k])}" for k in ("sigma", "a", "b") if k in p]
            text += f" ({p['shrink']} {' '.join(extra)})"
        return text


# -- candidates ---------------------------------------------------------------------------------


def _spectral_params(fixed: dict) -> dict:
    if not fixed:
        return {}
    spec = ShrinkSpec(
        shrink=str(fixed.get("shrink", "hard")),
        scale=float(fixed.get("scale", 1.0)),
        noise=str(fixed.get("noise", "known" if "sigma" in fixed else "median")),
        sigma=None if fixed.get("sigma") is None else float(fixed["sigma"]),
        a=float(fixed.get("a", 1.0)),
        b=float(fixed.get("b", 0.0)),
    )
    p: dict = {"shrink": spec.shrink, "scale": spec.scale, "noise": spec.noise}
    if spec.noise == "known":
        p["sigma"] = spec.sigma
    if spec.shrink == "twoknob":
        p["a"], p["b"] = spec.a, spec.b
    return p


def group_ranges(num_layers: int, groups: int) -> list[tuple[int, int]]:
    """``groups`` contiguous block ranges of near-equal size covering 0 … L−1."""
    g = min(groups, num_layers)
    return [(k * num_layers // g, (k + 1) * num_layers // g - 1) for k in range(g)]


def group_names(num_layers: int, groups: int) -> list[str]:
    return [
        "embed",
        *[f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in group_ranges(num_layers, groups)],
        "head",
    ]


def group_schedule(point: GroupPoint, num_layers: int, groups: int) -> LayerSchedule:
    """Every block's λ(ℓ) = α + β·ℓ/(L−1) + δ of its group (embeddings: α + δ, head: α + β + δ)."""
    a, b = point.base
    ranges = group_ranges(num_layers, groups)
    if len(point.offsets) != len(ranges) + 2:
        raise InputError(f"internal error: {len(point.offsets)} offsets for {len(ranges) + 2} groups")
    d_embed, d_head = point.offsets[0], point.offsets[-1]
    items: list = [("embed", round_sig(a + d_embed, STRENGTH_DIGITS))]
    for k, (lo, hi) in enumerate(ranges):
        for i in range(lo, hi + 1):
            lam = round_sig(a + b * place_depth(i, num_layers) + point.offsets[k + 1], STRENGTH_DIGITS)
            items.append(((i, i), lam))
    items.append(("head", round_sig(a + b + d_head, STRENGTH_DIGITS)))
    merged: list = []
    for key, lam in items:  # consecutive blocks with equal λ: one range
        if merged and isinstance(key, tuple) and isinstance(merged[-1][0], tuple) and merged[-1][1] == lam:
            merged[-1] = ((merged[-1][0][0], key[1]), lam)
        else:
            merged.append((key, lam))
    return LayerSchedule(groups=tuple(merged), option="--layer-strengths")


def make_candidate(entry: LinesEntry, value: object, *, n_fts: int, where: str = "candidate") -> Candidate:
    """The candidate at an (α, β) pair or a :class:`GroupPoint`; every parameter explicit."""
    try:
        return _make(entry, value)
    except InputError as exc:
        raise InputError(f"{where}: {exc}") from None


def _make(entry: LinesEntry, value: object) -> Candidate:
    if entry.merge_params is not None:
        return _make_merge(entry, value)
    p = _spectral_params(entry.fixed)
    if isinstance(value, GroupPoint):
        if entry.num_layers is None:
            raise InputError("internal error: per-group candidates need the model's number of layers")
        sched = group_schedule(value, entry.num_layers, entry.groups)
        p["layer_strengths"] = sched.spec
        p["lines_base"] = tuple(float(x) for x in value.base)
        p["offsets"] = tuple(float(x) for x in value.offsets)
        p["group_names"] = tuple(group_names(entry.num_layers, entry.groups))
        axis, val = "layer_strengths", tuple(value.base)
    else:
        a, b = value  # type: ignore[misc]
        a, b = float(a), float(b)
        if not (math.isfinite(a) and math.isfinite(b)):
            raise InputError(f"--lines needs finite numbers, got {a},{b}")
        p["lines"] = (a, b)
        axis, val = "lines", (a, b)
    params = tuple(sorted(p.items()))
    return LinesCandidate(
        entry=entry.index,
        family=FAMILY,
        command="repair",
        axis=axis,
        value=val,
        params=params,  # type: ignore[arg-type]
    )


def _make_merge(entry: LinesEntry, value: object) -> Candidate:
    """A merge candidate (its method's parameters as found) under ``--lines α,β``."""
    if isinstance(value, GroupPoint):
        raise InputError("internal error: per-group refinement is not defined for merge schedules")
    a, b = value  # type: ignore[misc]
    a, b = float(a), float(b)
    if not (math.isfinite(a) and math.isfinite(b)):
        raise InputError(f"--lines needs finite numbers, got {a},{b}")
    p = {**dict(entry.merge_params or ()), "lines": (a, b)}
    return Candidate(
        entry=entry.index,
        family=str(p["method"]),
        command="merge",
        axis="lines",
        value=(a, b),  # type: ignore[arg-type]
        params=tuple(sorted(p.items())),
    )
