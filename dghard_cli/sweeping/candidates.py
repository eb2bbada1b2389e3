"""Candidate families of ``dghard sweep``: what a family, an entry of the candidate file
(``--candidates``) and a candidate are, and where a reproduction command writes.

A *family* is one way to change the fine-tune's update, with one *strength axis*:

=================  =========  ================================================  ==============
family             command    what the axis value means                         default axis
=================  =========  ================================================  ==============
hard               repair     DG-Hard: keep σ > s·τ (``--shrink hard``)          scale (log)
soft               repair     σ → max(σ − s·τ, 0) (``--shrink soft``)            scale (log)
optimal            repair     Gavish–Donoho 2017 shrinker, noise × s             scale (log)
twoknob            repair     a·spikes + b·bulk (spikes: σ > s·τ)                b (a = 1)
wise-ft            merge      (1 − α)·W_base + α·W_ft                            alpha
task-arithmetic    merge      W_base + λ·Σ w_i Δ_i                               lambda
ties               merge      TIES at keep fraction ``density``                  density (log)
dare-linear        merge      DARE at keep fraction ``density``                  density (log)
dare-ties          merge      DARE-TIES at keep fraction ``density``             density (log)
dg-hard            merge      DG-Hard on each Δ_i at scale s, then summed        scale (log)
tsv                merge      TSV-M: α·polar(U_cat)·Σ_cat·polar(V_cat)ᵀ           alpha (0-3)
iso-c              merge      Iso-C: α × the flat spectrum of Σ_i Δ_i            alpha (0-3)
iso-cts            merge      Iso-CTS: the same, common + task directions        alpha (0-3)
lines              repair     λ(ℓ) = α + β·ℓ/(L−1) on every layer (LiNeS)        (α, β): 2-D
=================  =========  ================================================  ==============

The ``lines`` family is two-dimensional and lives in :mod:`dghard_cli.sweeping.lines`; a
candidate of any family is made, reproduced and written by its family
(:mod:`dghard_cli.sweeping.families`). With several fine-tunes the
candidate file's ``merges:`` block (:mod:`dghard_cli.sweeping.merges`) makes one entry per
registered merge method and, for the best merge, follow-ups: its density, and the merge under
``--lines α,β`` (a merge candidate whose parameters carry ``lines``).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field

from dghard_cli.methods import registry
from dghard_cli.numbers import flag_value, is_finite_number

#: Probes found by refinement are rounded to this many significant digits (short commands;
#: a probe that rounds onto an evaluated value ends that family's refinement).
SIGNIFICANT_DIGITS = 4
#: Default refinement tolerance: stop when the bracket is narrower than this share of the range.
DEFAULT_TOLERANCE = 0.02


@dataclass(frozen=True)
class FamilyKind:
    """What a family name means: its command, axes, parameters and defaults."""

    name: str
    command: str  # "repair" | "merge"
    axes: tuple[str, ...]  # parameters that may be swept (the first is the default)
    fixed: tuple[str, ...]  # parameters that may be fixed
    ranges: dict[str, tuple[float, float]]  # default refinement range per axis
    log_axes: frozenset[str]  # axes refined in log coordinates by default
    fine_tunes: str  # "one" (exactly one fine-tune) | "any"
    default_when: str  # "one" | "several": when an entry applies by default


_SCALE_RANGE = (0.25, 16.0)
_REPAIR_FIXED = ("noise", "sigma")


def _repair_kind(
    name: str,
    axes: tuple[str, ...] = ("scale",),
    fixed: tuple[str, ...] = _REPAIR_FIXED,
    ranges: dict[str, tuple[float, float]] | None = None,
) -> FamilyKind:
    """A repair shrinker's family: one fine-tune, the threshold scale refined in log coordinates."""
    return FamilyKind(
        name, "repair", axes, fixed, ranges or {"scale": _SCALE_RANGE}, frozenset({"scale"}), "one", "one"
    )


KINDS: dict[str, FamilyKind] = {
    k.name: k
    for k in (
        _repair_kind("hard"),
        _repair_kind("soft", ranges={"scale": (0.05, 8.0)}),
        _repair_kind("optimal"),
        _repair_kind(
            "twoknob",
            ("b", "a", "scale"),
            ("a", "b", "scale", *_REPAIR_FIXED),
            {"a": (0.0, 1.0), "b": (0.0, 1.0), "scale": _SCALE_RANGE},
        ),
        # two axes (α, β): parsed, searched and written by sweeping/lines.py
        FamilyKind(
            "lines",
            "repair",
            ("lines",),
            ("shrink", "scale", "noise", "sigma", "a", "b"),
            {},
            frozenset(),
            "one",
            "one",
        ),
    )
}


def _merge_kind(m: registry.MergeMethod) -> FamilyKind:
    """A merge method's sweep family, from its declaration in the registry."""
    par = registry.params()
    return FamilyKind(
        m.name,
        "merge",
        m.sweep_axes,
        m.sweep_fixed,
        {a: m.sweep_range(par[a]) for a in m.sweep_axes},  # type: ignore[misc]
        frozenset(a for a in m.sweep_axes if par[a].sweep_log),
        m.fine_tunes,
        "one" if m.fine_tunes == "one" else "several",
    )


KINDS.update({m.name: _merge_kind(m) for m in registry.methods().values() if m.sweep_axes})


def kinds() -> dict[str, FamilyKind]:
    """Every family: the repair kinds and one per merge method of the registry *as it is now*
    (a method module found after this module was imported is a family too)."""
    merges = {m.name: _merge_kind(m) for m in registry.methods().values() if m.sweep_axes}
    return {**{k: v for k, v in KINDS.items() if v.command == "repair"}, **merges}


@dataclass
class FamilyEntry:
    """One entry of the candidate file: a family, its axis, coarse grid and refinement range."""

    family: str
    grid: list[float]
    axis: str | None = None  # None: the family's default axis
    range: tuple[float, float] | None = None  # None: the family's default range
    log: bool | None = None  # None: the axis's default
    tolerance: float = DEFAULT_TOLERANCE
    refine: bool = True
    fixed: dict = field(default_factory=dict)
    fine_tunes: str | None = None  # "one" | "several" | "any"; None: the family's default
    index: int = 0  # position in the file (for messages and the report)
    #: where the entry comes from: "file" (an entry of ``families``), "merges" (made from the
    #: ``merges:`` block, one per registered merge method), "follow-up" (sweeping/merges.py)
    origin: str = "file"
    followups: dict | None = None  # "merges" entries: the block's density grid and lines pairs

    @property
    def kind(self) -> FamilyKind:
        return KINDS.get(self.family) or kinds()[self.family]

    @property
    def lo(self) -> float:
        return self.range[0]  # type: ignore[index]

    @property
    def hi(self) -> float:
        return self.range[1]  # type: ignore[index]

    def coord(self, x: float) -> float:
        """Position on the axis in the coordinates refinement works in (log or linear)."""
        return math.log(x) if self.log else x

    def value(self, u: float) -> float:
        return math.exp(u) if self.log else u

    def applies(self, n_fts: int) -> bool:
        when = self.fine_tunes or self.kind.default_when
        return when == "any" or (when == "one") == (n_fts == 1)

    def describe(self) -> dict:
        d = {
            "index": self.index,
            "family": self.family,
            "command": self.kind.command,
            "axis": self.axis,
            "grid": list(self.grid),
            "range": list(self.range or ()),
            "log": self.log,
            "tolerance": self.tolerance,
            "refine": self.refine,
            "fixed": {k: list(v) if isinstance(v, tuple) else v for k, v in self.fixed.items()},
            "fine_tunes": self.fine_tunes or self.kind.default_when,
        }
        if self.origin != "file":
            d["origin"] = self.origin
        return d


@dataclass(frozen=True)
class Candidate:
    """One point: an entry's family at one axis value, with every parameter explicit."""

    entry: int
    family: str
    command: str
    axis: str
    value: float
    params: tuple  # sorted (name, value) pairs, every parameter of the command explicit

    @property
    def param_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.params}

    @property
    def label(self) -> str:
        extra = [
            f"{k}={_fmt(v)}"
            for k, v in self.params
            if k not in (self.axis, "shrink", "method", "noise")
            and v is not None
            and k in _SHOWN
            and not (k == "weights" and all(w == 1.0 for w in v))  # the default: not shown
        ]
        return f"{self.family} {self.axis}={_fmt(self.value)}" + (f" ({', '.join(extra)})" if extra else "")


#: Fixed parameters shown in a candidate's label (the rest are in its parameters).
_SHOWN = {"a", "b", "scale", "sigma", "density", "lambda", "weights", "seed", "calibrate"}


def _fmt(v: object) -> str:
    return flag_value(v)


def round_sig(x: float, digits: int = SIGNIFICANT_DIGITS) -> float:
    """``x`` rounded to ``digits`` significant digits (0 stays 0)."""
    if x == 0 or not math.isfinite(x):
        return float(x)
    return float(f"{x:.{digits}g}")


def is_number(v: object) -> bool:
    """A finite int or float (not a bool) that a float holds (a YAML 10**400 is not a number)."""
    return is_finite_number(v)


#: The printed reproduction command writes to OUT + this (OUT itself holds the winner).
REPRODUCED_SUFFIX = "-reproduced"


def reproduced_out(out: str) -> str:
    """Where the printed reproduction command writes: beside OUT (which holds the winner)."""
    return (out.rstrip("/") or out) + REPRODUCED_SUFFIX


def shell_command(argv: list[str]) -> str:
    return shlex.join(argv)
