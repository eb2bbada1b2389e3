"""Candidate families of ``dghard sweep``: what a candidate is, how it is written, how it is
reproduced, and the YAML file that lists them (``--candidates``).

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
=================  =========  ================================================  ==============

Every candidate is written by the library function of its command (``repair`` or ``merge``),
so it is byte for byte what the printed command writes.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from dghard_cli.engine.adapter_run import LoraOutputOptions
from dghard_cli.engine.runner import RunOptions
from dghard_cli.errors import InputError
from dghard_cli.merge import MergeOptions, merge, resolve_parameters
from dghard_cli.methods.recipe import read_yaml_file
from dghard_cli.repair import RepairOptions, repair
from dghard_cli.spectral.spectrum import ShrinkSpec

MAX_CANDIDATES_BYTES = 1024 * 1024
DEFAULT_CANDIDATES = "sweep-default.yaml"
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
KINDS: dict[str, FamilyKind] = {
    k.name: k
    for k in (
        FamilyKind(
            "hard",
            "repair",
            ("scale",),
            _REPAIR_FIXED,
            {"scale": _SCALE_RANGE},
            frozenset({"scale"}),
            "one",
            "one",
        ),
        FamilyKind(
            "soft",
            "repair",
            ("scale",),
            _REPAIR_FIXED,
            {"scale": (0.05, 8.0)},
            frozenset({"scale"}),
            "one",
            "one",
        ),
        FamilyKind(
            "optimal",
            "repair",
            ("scale",),
            _REPAIR_FIXED,
            {"scale": _SCALE_RANGE},
            frozenset({"scale"}),
            "one",
            "one",
        ),
        FamilyKind(
            "twoknob",
            "repair",
            ("b", "a", "scale"),
            ("a", "b", "scale", *_REPAIR_FIXED),
            {"a": (0.0, 1.0), "b": (0.0, 1.0), "scale": _SCALE_RANGE},
            frozenset({"scale"}),
            "one",
            "one",
        ),
        FamilyKind("wise-ft", "merge", ("alpha",), (), {"alpha": (0.0, 1.0)}, frozenset(), "one", "one"),
        FamilyKind(
            "task-arithmetic",
            "merge",
            ("lambda",),
            ("weights",),
            {"lambda": (0.0, 2.0)},
            frozenset(),
            "any",
            "several",
        ),
        FamilyKind(
            "ties",
            "merge",
            ("density", "lambda"),
            ("weights", "density", "lambda"),
            {"density": (0.01, 1.0), "lambda": (0.0, 2.0)},
            frozenset({"density"}),
            "any",
            "several",
        ),
        FamilyKind(
            "dare-linear",
            "merge",
            ("density", "lambda"),
            ("weights", "density", "lambda", "seed"),
            {"density": (0.01, 1.0), "lambda": (0.0, 2.0)},
            frozenset({"density"}),
            "any",
            "several",
        ),
        FamilyKind(
            "dare-ties",
            "merge",
            ("density", "lambda"),
            ("weights", "density", "lambda", "seed"),
            {"density": (0.01, 1.0), "lambda": (0.0, 2.0)},
            frozenset({"density"}),
            "any",
            "several",
        ),
        FamilyKind(
            "dg-hard",
            "merge",
            ("scale", "lambda"),
            ("weights", "scale", "lambda"),
            {"scale": _SCALE_RANGE, "lambda": (0.0, 2.0)},
            frozenset({"scale"}),
            "any",
            "several",
        ),
    )
}

ENTRY_KEYS = ("family", "axis", "grid", "range", "log", "tolerance", "refine", "fixed", "fine_tunes")


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

    @property
    def kind(self) -> FamilyKind:
        return KINDS[self.family]

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
        return {
            "index": self.index,
            "family": self.family,
            "command": self.kind.command,
            "axis": self.axis,
            "grid": list(self.grid),
            "range": list(self.range or ()),
            "log": self.log,
            "tolerance": self.tolerance,
            "refine": self.refine,
            "fixed": dict(self.fixed),
            "fine_tunes": self.fine_tunes or self.kind.default_when,
        }


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
            if k not in (self.axis, "shrink", "method", "noise") and v is not None and k in _SHOWN
        ]
        return f"{self.family} {self.axis}={_fmt(self.value)}" + (f" ({', '.join(extra)})" if extra else "")


#: Fixed parameters shown in a candidate's label (the rest are in its parameters).
_SHOWN = {"a", "b", "scale", "sigma", "density", "lambda", "weights", "seed"}


def _fmt(v: object) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join(_fmt(x) for x in v)
    if isinstance(v, float):
        return repr(v)
    return str(v)


def round_sig(x: float, digits: int = SIGNIFICANT_DIGITS) -> float:
    """``x`` rounded to ``digits`` significant digits (0 stays 0)."""
    if x == 0 or not math.isfinite(x):
        return float(x)
    return float(f"{x:.{digits}g}")


# -- reading the candidate file ----------------------------------------------------------------


def _num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))


def parse_entry(raw: object, index: int, where: str) -> FamilyEntry:
    """Validate one entry of ``families``; InputError naming the file and entry otherwise."""
    at = f"{where}: families[{index}]"
    if not isinstance(raw, dict):
        raise InputError(f"{at}: expected a mapping with 'family' and 'grid', got {type(raw).__name__}")
    fam = raw.get("family")
    if not isinstance(fam, str) or fam.strip().lower() not in KINDS and fam.strip().lower() != "dare":
        raise InputError(f"{at}: 'family' must be one of {', '.join(KINDS)}, got {fam!r}")
    fam = fam.strip().lower()
    fam = "dare-linear" if fam == "dare" else fam
    at = f"{at} ({fam})"
    for key in raw:
        if key not in ENTRY_KEYS:
            raise InputError(f"{at}: unknown key {key!r} (known keys: {', '.join(ENTRY_KEYS)})")
    kind = KINDS[fam]
    axis = raw.get("axis", kind.axes[0])
    if axis not in kind.axes:
        raise InputError(f"{at}: axis {axis!r} cannot be swept for {fam} (axes: {', '.join(kind.axes)})")
    grid = raw.get("grid")
    if isinstance(grid, (int, float)) and not isinstance(grid, bool):
        grid = [grid]
    if not isinstance(grid, list) or not grid or not all(_num(g) for g in grid):
        raise InputError(f"{at}: 'grid' must be a non-empty list of numbers (values of {axis})")
    grid = [float(g) for g in grid]
    rng = raw.get("range", kind.ranges[axis])
    if (
        not isinstance(rng, (list, tuple))
        or len(rng) != 2
        or not all(_num(x) for x in rng)
        or not float(rng[0]) < float(rng[1])
    ):
        raise InputError(f"{at}: 'range' must be [low, high] with low < high, got {rng!r}")
    rng = (float(rng[0]), float(rng[1]))
    log = raw.get("log", axis in kind.log_axes)
    if not isinstance(log, bool):
        raise InputError(f"{at}: 'log' must be true or false")
    if log and rng[0] <= 0:
        raise InputError(f"{at}: a log axis needs range low > 0, got {rng[0]:g} (set log: false)")
    for g in grid:
        if not rng[0] <= g <= rng[1]:
            raise InputError(f"{at}: grid value {g:g} lies outside range [{rng[0]:g}, {rng[1]:g}]")
    tol = raw.get("tolerance", DEFAULT_TOLERANCE)
    if not _num(tol) or not 0 < float(tol) <= 1:
        raise InputError(f"{at}: 'tolerance' must be a number in (0, 1] (share of the range)")
    refine = raw.get("refine", True)
    if not isinstance(refine, bool):
        raise InputError(f"{at}: 'refine' must be true or false")
    fixed = raw.get("fixed", {}) or {}
    if not isinstance(fixed, dict):
        raise InputError(f"{at}: 'fixed' must be a mapping of parameter: value")
    for key in fixed:
        if key not in kind.fixed:
            allowed = ", ".join(kind.fixed) or "none"
            raise InputError(f"{at}: parameter {key!r} cannot be fixed for {fam} (allowed: {allowed})")
        if key == axis:
            raise InputError(f"{at}: {key!r} is the swept axis and cannot also be fixed")
        val = fixed[key]
        ok = (
            isinstance(val, str)
            if key == "noise"
            else isinstance(val, list) and bool(val) and all(_num(w) for w in val)
            if key == "weights"
            else isinstance(val, int) and not isinstance(val, bool)
            if key == "seed"
            else _num(val)
        )
        if not ok:
            want = {"noise": "median or known", "weights": "a list of numbers", "seed": "an integer"}
            raise InputError(f"{at}: fixed {key} must be {want.get(key, 'a number')}, got {val!r}")
    when = raw.get("fine_tunes")
    if when is not None:
        if when not in ("one", "several", "any"):
            raise InputError(f"{at}: 'fine_tunes' must be one, several or any, got {when!r}")
        if kind.fine_tunes == "one" and when != "one":
            raise InputError(f"{at}: {fam} takes exactly one fine-tune (fine_tunes: one)")
    entry = FamilyEntry(
        family=fam,
        grid=grid,
        axis=axis,
        range=rng,
        log=log,
        tolerance=float(tol),
        refine=refine,
        fixed=dict(fixed),
        fine_tunes=when,
        index=index,
    )
    if kind.command == "repair" or kind.fine_tunes == "one":
        check_entry(entry, 1, at)  # merge entries are checked once the fine-tunes are known
    return entry


def check_entry(entry: FamilyEntry, n_fts: int, where: str) -> None:
    """Every parameter of the candidates this entry may produce (grid and range ends)."""
    for v in (*entry.grid, entry.lo, entry.hi):
        make_candidate(entry, v, n_fts=n_fts, where=where)


def parse_candidates(doc: object, where: str) -> list[FamilyEntry]:
    if not isinstance(doc, dict) or "families" not in doc:
        raise InputError(f"{where}: expected a mapping with a 'families' list")
    unknown = [k for k in doc if k != "families"]
    if unknown:
        raise InputError(f"{where}: unknown top-level key {unknown[0]!r} (known: families)")
    fams = doc["families"]
    if not isinstance(fams, list) or not fams:
        raise InputError(f"{where}: 'families' must be a non-empty list")
    return [parse_entry(raw, i, where) for i, raw in enumerate(fams)]


def load_candidates(path: str | Path | None) -> tuple[list[FamilyEntry], str]:
    """The entries of a candidate file (None: the built-in default set) and its name."""
    import yaml

    if path is None:
        text = resources.files("dghard_cli").joinpath("data", DEFAULT_CANDIDATES).read_text(encoding="utf-8")
        where = f"built-in {DEFAULT_CANDIDATES}"
        doc = yaml.safe_load(text)
    else:
        where = f"--candidates {path}"
        doc = read_yaml_file(Path(path).expanduser(), where, MAX_CANDIDATES_BYTES)
    return parse_candidates(doc, where), where


# -- candidates -------------------------------------------------------------------------------


def make_candidate(entry: FamilyEntry, value: float, *, n_fts: int, where: str = "candidate") -> Candidate:
    """The candidate of ``entry`` at axis value ``value``: every parameter explicit and checked."""
    try:
        return _make_candidate(entry, value, n_fts)
    except InputError as exc:
        raise InputError(f"{where}: {exc}") from None


def _make_candidate(entry: FamilyEntry, value: float, n_fts: int) -> Candidate:
    kind = entry.kind
    axis = entry.axis or kind.axes[0]
    value = float(value)
    vals = {**entry.fixed, axis: value}
    if kind.command == "repair":
        shrink = entry.family
        spec = ShrinkSpec(
            shrink=shrink,
            scale=float(vals.get("scale", 1.0)),
            noise=str(vals.get("noise", "known" if "sigma" in vals else "median")),
            sigma=None if vals.get("sigma") is None else float(vals["sigma"]),
            a=float(vals.get("a", 1.0)),
            b=float(vals.get("b", 0.0)),
        )
        p = {"shrink": spec.shrink, "scale": spec.scale, "noise": spec.noise}
        if spec.noise == "known":
            p["sigma"] = spec.sigma
        if shrink == "twoknob":
            p["a"], p["b"] = spec.a, spec.b
    else:
        weights = vals.get("weights")
        if weights is not None and (not isinstance(weights, list) or not all(_num(w) for w in weights)):
            raise InputError("'weights' must be a list of numbers")
        opts = MergeOptions(
            method=entry.family,
            alpha=vals.get("alpha"),
            weights=None if weights is None else [float(w) for w in weights],
            lam=vals.get("lambda"),
            density=vals.get("density"),
            seed=vals.get("seed"),
            scale=vals.get("scale"),
        )
        p = resolve_parameters(opts, n_fts)
        p = {
            k: v
            for k, v in p.items()
            if k in ("method", "alpha", "weights", "lambda", "density", "seed", "scale")
        }
    params = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in p.items()))
    return Candidate(
        entry=entry.index, family=entry.family, command=kind.command, axis=axis, value=value, params=params
    )


def degenerate_on_adapters(entry: FamilyEntry) -> bool:
    """A family whose cut needs the unknown-noise threshold, undefined on a LoRA update."""
    if entry.family == "dg-hard":
        return True
    return (
        entry.kind.command == "repair" and "sigma" not in entry.fixed and entry.fixed.get("noise") != "known"
    )


def reproduce_argv(
    cand: Candidate, base: str, fts: list[str], out: str, device: str, *, merge_adapters: bool = False
) -> list[str]:
    """The one ``dghard repair``/``dghard merge`` command line that writes this candidate
    (``merge_adapters``: the fine-tunes are LoRA adapters, written as the full merged checkpoint)."""
    p = cand.param_dict
    dev = ["--device", device] if device != "auto" else []
    dev = (["--merge"] if merge_adapters else []) + dev
    if cand.command == "repair":
        argv = ["dghard", "repair", base, fts[0], out, "--shrink", p["shrink"], "--scale", _fmt(p["scale"])]
        if p["shrink"] == "twoknob":
            argv += ["--a", _fmt(p["a"]), "--b", _fmt(p["b"])]
        if p["noise"] == "known":
            argv += ["--noise", "known", "--sigma", _fmt(p["sigma"])]
        return argv + dev
    argv = ["dghard", "merge", "--method", p["method"]]
    for key, flag in (
        ("alpha", "--alpha"),
        ("weights", "--weights"),
        ("lambda", "--lambda"),
        ("density", "--density"),
        ("seed", "--seed"),
        ("scale", "--scale"),
    ):
        if key in p:
            argv += [flag, _fmt(p[key])]
    return argv + [base, *fts, "--out", out] + dev


def shell_command(argv: list[str]) -> str:
    return shlex.join(argv)


def write_candidate(
    cand: Candidate,
    base: str,
    fts: list[str],
    out: Path,
    *,
    device: str,
    argv: list[str],
    merge_adapters: bool = False,
) -> dict:
    """Write ``cand`` into ``out`` with the command's own library function; returns its report."""
    p = cand.param_dict
    run = RunOptions(device=device, quiet=True, argv=argv)
    lora = LoraOutputOptions(merge=merge_adapters)
    if cand.command == "repair":
        spec = ShrinkSpec(
            shrink=p["shrink"],
            scale=p["scale"],
            noise=p["noise"],
            sigma=p.get("sigma"),
            a=p.get("a", 1.0),
            b=p.get("b", 0.0),
        )
        return repair(base, fts[0], out, RepairOptions(spec=spec, run=run, lora=lora))
    opts = MergeOptions(
        method=p["method"],
        alpha=p.get("alpha"),
        weights=p.get("weights"),
        lam=p.get("lambda"),
        density=p.get("density"),
        seed=p.get("seed"),
        scale=p.get("scale"),
        run=run,
        lora=lora,
    )
    return merge(base, fts, out, opts)
