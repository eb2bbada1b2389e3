"""The ``lines`` family of ``dghard sweep``: layer-wise strengths λ(ℓ) = α + β·ℓ/(L−1) (LiNeS).

A candidate is ``dghard repair BASE FT OUT --lines α,β`` (W = W_base + λ(ℓ)·Δ), or, with a
shrinker in ``fixed`` (``{shrink: hard, scale: 1.0}``), ``… --lines α,β --shrink hard --scale 1.0``
(W = W_base + λ(ℓ)·Δ*). The search is two-dimensional:

1. **Coarse**: the entry's ``grid`` of (α, β) points — a list of pairs, evaluated in that order,
   or ``{alpha: [...], beta: [...]}`` for their product (α-major) — round-robin with the other
   entries, as for every family.
2. **Local refinement** (a compass search): around the best (α, β) so far, the next probe is the
   first unevaluated point of ``best ± s·span`` along α, then along β (+ before −), where the step
   ``s`` (a share of each axis's range) starts at the distance to the nearest evaluated point
   (at most ``step``, default 0.1) and halves whenever all four neighbours are evaluated; the
   stage is done when ``s`` falls below ``tolerance``. Probes are rounded to 4 significant digits
   and clipped to the ranges.
3. **Per-group refinement** (``dghard sweep --refine groups``), once the (α, β) stage is done: a
   coordinate search of the same kind on per-group offsets δ added to the best schedule —
   groups: the embeddings, ``groups`` (default 4) contiguous ranges of blocks, the head — written
   as ``--layer-strengths`` with every block's λ(ℓ) = α + β·ℓ/(L−1) + δ_g. It starts from the best
   (α, β) candidate (δ = 0, already evaluated) and goes on as long as the budget lasts (or until
   its step falls below the tolerance). Offsets lie in ``group_range`` (default [−0.5, 0.5]).

Every probe is a pure function of what has been evaluated (like the golden-section search of the
other families), so a resumed sweep takes the same steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from dghard_cli.architecture import place_depth
from dghard_cli.engine.runner import RunOptions
from dghard_cli.errors import InputError
from dghard_cli.io.checkpoint import Checkpoint
from dghard_cli.methods.declare import LAYER_STRENGTHS, LINES
from dghard_cli.methods.schedule import (
    LayerSchedule,
    checkpoint_depth,
    parse_layer_strengths,
    schedule_problem,
)
from dghard_cli.repair import RepairOptions, repair
from dghard_cli.spectral.spectrum import ShrinkSpec
from dghard_cli.sweep.candidates import (
    DEFAULT_TOLERANCE,
    Candidate,
    FamilyEntry,
    _fmt,
    round_sig,
)
from dghard_cli.sweep.candidates import is_number as _num

FAMILY = "lines"
ENTRY_KEYS = (
    "family",
    "grid",
    "range",
    "step",
    "tolerance",
    "refine",
    "fixed",
    "fine_tunes",
    "groups",
    "group_range",
)
DEFAULT_RANGE = {"alpha": (0.0, 1.0), "beta": (0.0, 1.0)}
DEFAULT_STEP = 0.1
DEFAULT_GROUPS = 4
DEFAULT_GROUP_RANGE = (-0.5, 0.5)
SPECTRAL_KEYS = ("shrink", "scale", "noise", "sigma", "a", "b")
#: Digits of a per-group candidate's strengths (the schedule it writes: readable commands).
STRENGTH_DIGITS = 6

Objective = tuple | None


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

    def describe(self) -> dict:
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


# -- the candidate file ----------------------------------------------------------------------------


def _pair_list(raw: object, at: str) -> list[tuple[float, float]]:
    if isinstance(raw, dict):
        keys = set(raw)
        if keys != {"alpha", "beta"}:
            raise InputError(f"{at}: a grid mapping takes exactly 'alpha' and 'beta' lists")
        lists = []
        for k in ("alpha", "beta"):
            v = raw[k]
            v = [v] if _num(v) else v
            if not isinstance(v, list) or not v or not all(_num(x) for x in v):
                raise InputError(f"{at}: grid {k} must be a non-empty list of numbers")
            lists.append([float(x) for x in v])
        return [(a, b) for a in lists[0] for b in lists[1]]
    if not isinstance(raw, list) or not raw:
        raise InputError(
            f"{at}: 'grid' must be a list of [alpha, beta] pairs or {{alpha: [...], beta: [...]}}"
        )
    out = []
    for p in raw:
        if not isinstance(p, list) or len(p) != 2 or not all(_num(x) for x in p):
            raise InputError(f"{at}: grid point {p!r} is not a pair [alpha, beta]")
        out.append((float(p[0]), float(p[1])))
    return out


def _interval(raw: object, at: str, what: str) -> tuple[float, float]:
    if not isinstance(raw, (list, tuple)) or len(raw) != 2 or not all(_num(x) for x in raw):
        raise InputError(f"{at}: {what} must be [low, high], got {raw!r}")
    lo, hi = float(raw[0]), float(raw[1])
    if not lo < hi:
        raise InputError(f"{at}: {what} must have low < high, got {raw!r}")
    return lo, hi


def parse_entry(raw: dict, index: int, where: str) -> LinesEntry:
    """Validate a ``lines`` entry; InputError naming the file and entry otherwise."""
    at = f"{where}: families[{index}] (lines)"
    for key in raw:
        if key not in ENTRY_KEYS:
            raise InputError(f"{at}: unknown key {key!r} (known keys: {', '.join(ENTRY_KEYS)})")
    grid = _pair_list(raw.get("grid"), at)
    rng = raw.get("range", {})
    if not isinstance(rng, dict) or not set(rng) <= {"alpha", "beta"}:
        raise InputError(f"{at}: 'range' must be a mapping {{alpha: [low, high], beta: [low, high]}}")
    ar = _interval(rng.get("alpha", DEFAULT_RANGE["alpha"]), at, "range alpha")
    br = _interval(rng.get("beta", DEFAULT_RANGE["beta"]), at, "range beta")
    for a, b in grid:
        if not (ar[0] <= a <= ar[1] and br[0] <= b <= br[1]):
            raise InputError(
                f"{at}: grid point [{a:g}, {b:g}] lies outside range alpha [{ar[0]:g}, {ar[1]:g}], "
                f"beta [{br[0]:g}, {br[1]:g}]"
            )
    step = raw.get("step", DEFAULT_STEP)
    tol = raw.get("tolerance", DEFAULT_TOLERANCE)
    for name, v in (("step", step), ("tolerance", tol)):
        if not _num(v) or not 0 < float(v) <= 1:
            raise InputError(f"{at}: '{name}' must be a number in (0, 1] (share of the range)")
    refine = raw.get("refine", True)
    if not isinstance(refine, bool):
        raise InputError(f"{at}: 'refine' must be true or false")
    fixed = raw.get("fixed", {}) or {}
    if not isinstance(fixed, dict):
        raise InputError(f"{at}: 'fixed' must be a mapping of parameter: value")
    for key, val in fixed.items():
        if key not in SPECTRAL_KEYS:
            raise InputError(
                f"{at}: parameter {key!r} cannot be fixed for lines (allowed: {', '.join(SPECTRAL_KEYS)})"
            )
        ok = isinstance(val, str) if key in ("shrink", "noise") else _num(val)
        if not ok:
            raise InputError(
                f"{at}: fixed {key} must be {'a name' if key in ('shrink', 'noise') else 'a number'}"
            )
    when = raw.get("fine_tunes")
    if when is not None and when != "one":
        raise InputError(f"{at}: lines takes exactly one fine-tune (fine_tunes: one)")
    groups = raw.get("groups", DEFAULT_GROUPS)
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise InputError(f"{at}: 'groups' must be a whole number >= 1 (block ranges for --refine groups)")
    grange = _interval(raw.get("group_range", list(DEFAULT_GROUP_RANGE)), at, "group_range")
    if not grange[0] <= 0 <= grange[1]:
        raise InputError(f"{at}: group_range must contain 0 (the best schedule itself), got {list(grange)}")
    entry = LinesEntry(
        family=FAMILY,
        grid=list(grid),  # type: ignore[arg-type]
        axis="lines",
        range=ar,
        log=False,
        tolerance=float(tol),
        refine=refine,
        fixed=dict(fixed),
        fine_tunes="one",
        index=index,
        alpha_range=ar,
        beta_range=br,
        step=float(step),
        groups=groups,
        group_range=grange,
        grid_pairs=list(grid),
    )
    check_entry(entry, 1, at)
    return entry


def check_entry(entry: LinesEntry, n_fts: int, where: str) -> None:
    """Every candidate the entry may produce at its grid points and range corners."""
    corners = [(a, b) for a in entry.alpha_range for b in entry.beta_range]
    for point in (*entry.grid_pairs, *corners):
        make_candidate(entry, point, n_fts=n_fts, where=where)


def bind_entries(
    active: list[FamilyEntry],
    skipped: list[dict],
    base: Checkpoint,
    ft: Checkpoint,
    *,
    refine_groups: bool,
) -> list[str]:
    """Give the active ``lines`` entries FT's number of layers and switch on ``--refine groups``.

    A checkpoint whose layer depth cannot be read (two layer stacks, a tensor in no known
    place, a config disagreeing with the names) cannot take a schedule: its ``lines`` entries
    move from ``active`` to ``skipped`` with the reason, which is also returned as a warning —
    checked now, before anything is evaluated. With ``--refine groups`` that is an error.
    """
    lines = [e for e in active if isinstance(e, LinesEntry)]
    if refine_groups and not lines:
        raise InputError("--refine groups refines the lines family, which is not in the candidate set")
    if not lines:
        return []
    problem = schedule_problem(base, ft)
    if problem is None:
        depth = checkpoint_depth(ft)
        for e in lines:
            e.num_layers = depth.num_layers
            e.refine_groups = refine_groups
        return []
    if refine_groups:
        raise InputError(f"--refine groups: {problem}")
    for e in lines:
        active.remove(e)
        skipped.append({**e.describe(), "skipped": problem})
    if not active:
        raise InputError(f"no candidate family left: the lines family cannot run here ({problem})")
    return [f"the lines family was skipped: {problem}"]


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


def reproduce_argv(cand: Candidate, base: str, ft: str, out: str, device: str) -> list[str]:
    p = cand.param_dict
    argv = ["dghard", "repair", base, ft, out]
    if "lines" in p:
        argv += [LINES.cli_flag, f"{_fmt(p['lines'][0])},{_fmt(p['lines'][1])}"]
    else:
        argv += [LAYER_STRENGTHS.cli_flag, p["layer_strengths"]]
    if "shrink" in p:
        argv += ["--shrink", p["shrink"], "--scale", _fmt(p["scale"])]
        if p["shrink"] == "twoknob":
            argv += ["--a", _fmt(p["a"]), "--b", _fmt(p["b"])]
        if p["noise"] == "known":
            argv += ["--noise", "known", "--sigma", _fmt(p["sigma"])]
    return argv + (["--device", device] if device != "auto" else [])


def write_candidate(
    cand: Candidate, base: str, ft: str, out, *, device: str, argv: list[str], report_out: str | None = None
) -> dict:
    p = cand.param_dict
    if "lines" in p:
        schedule = LayerSchedule(alpha=float(p["lines"][0]), beta=float(p["lines"][1]))
    else:
        schedule = parse_layer_strengths(p["layer_strengths"])
    spec = None
    if "shrink" in p:
        spec = ShrinkSpec(
            shrink=p["shrink"],
            scale=p["scale"],
            noise=p["noise"],
            sigma=p.get("sigma"),
            a=p.get("a", 1.0),
            b=p.get("b", 0.0),
        )
    run = RunOptions(device=device, quiet=True, argv=argv, report_out=report_out)
    return repair(base, ft, out, RepairOptions(spec=spec, schedule=schedule, run=run))


# -- the search ---------------------------------------------------------------------------------


def compass_probe(
    points: dict[tuple[float, ...], Objective],
    lo: Sequence[float],
    hi: Sequence[float],
    step: float,
    tolerance: float,
) -> tuple[float, ...] | None:
    """The next probe of a compass search around the best of ``points``, or None when done.

    Steps are shares of each coordinate's range ``hi − lo``: the first step is the Chebyshev
    distance (in those shares) from the best point to the nearest other evaluated point, at
    most ``step``; coordinates are tried in order, + before −; the step halves when every
    neighbour at it is evaluated; below ``tolerance`` the search is done.
    """
    ok = {p: o for p, o in points.items() if o is not None}
    if not ok:
        return None
    best = max(ok, key=lambda p: (ok[p], tuple(-x for x in p)))  # equal objectives: the smallest point
    span = [h - low for low, h in zip(lo, hi, strict=True)]
    dist = [max(abs(q[d] - best[d]) / span[d] for d in range(len(best))) for q in points if q != best]
    s = round_sig(min([step, *[x for x in dist if x > 0]]))
    while s >= tolerance:
        for d in range(len(best)):
            for sign in (1.0, -1.0):
                # round(…, 12) first: 0.1 − 0.1·(1 − 2⁻⁵⁴) is 0, not 2.8e-17
                v = min(max(round_sig(round(best[d] + sign * s * span[d], 12)), lo[d]), hi[d])
                q = (*best[:d], v, *best[d + 1 :])
                if q != best and q not in points:
                    return q
        s /= 2
    return None


def refine_probe(entry: LinesEntry, points: dict[object, Objective]) -> object | None:
    """The next refinement probe of a ``lines`` entry: (α, β), then (with --refine groups) a
    :class:`GroupPoint`; None when both stages are done."""
    if not entry.refine:
        return None
    pairs = {p: o for p, o in points.items() if isinstance(p, tuple)}
    lo = (entry.alpha_range[0], entry.beta_range[0])
    hi = (entry.alpha_range[1], entry.beta_range[1])
    probe = compass_probe(pairs, lo, hi, entry.step, entry.tolerance)  # type: ignore[arg-type]
    if probe is not None:
        return probe
    if not entry.refine_groups or entry.num_layers is None:
        return None
    ok = {p: o for p, o in pairs.items() if o is not None}
    if not ok:
        return None
    best = max(ok, key=lambda p: (ok[p], tuple(-x for x in p)))
    n = len(group_ranges(entry.num_layers, entry.groups)) + 2
    offsets: dict[tuple[float, ...], Objective] = {(0.0,) * n: ok[best]}
    for p, o in points.items():
        if isinstance(p, GroupPoint) and p.base == best and len(p.offsets) == n:
            offsets[p.offsets] = o
    glo, ghi = [entry.group_range[0]] * n, [entry.group_range[1]] * n
    step = compass_probe(offsets, glo, ghi, entry.step, entry.tolerance)
    return None if step is None else GroupPoint(base=best, offsets=step)  # type: ignore[arg-type]


def entry_points(entry: LinesEntry, evaluated: dict[tuple, Objective]) -> dict[object, Objective]:
    """The evaluated points of a ``lines`` entry ((α, β) pairs and group points) and objectives."""
    out: dict[object, Objective] = {}
    for params, obj in evaluated.items():
        d = dict(params)
        if isinstance(d.get("lines"), tuple) and len(d["lines"]) == 2:
            point: object = tuple(float(x) for x in d["lines"])
        elif "offsets" in d and "lines_base" in d and entry.num_layers is not None:
            point = GroupPoint(base=tuple(d["lines_base"]), offsets=tuple(d["offsets"]))  # type: ignore[arg-type]
        else:
            continue
        try:
            same = _make(entry, point).params == params
        except InputError:
            same = False
        if same:
            out[point] = obj
    return out
