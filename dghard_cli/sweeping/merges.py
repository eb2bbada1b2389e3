"""Merges as first-class candidates of ``dghard sweep``: the candidate file's ``merges:`` block.

With several fine-tunes the default candidate set is not a fixed list of merge families but
one rule over the merge-method registry (:mod:`dghard_cli.methods.registry`):

1. **Strength**: every registered method that declares ``sweep_axes``, merges several
   fine-tunes, runs no calibration and is not in ``exclude`` gets one entry on its *strength
   axis* — ``lambda`` (the scale of the merged update) where the method sweeps it, else its
   first sweep axis (``alpha`` of a method that declares ``sweep_axes=("alpha", ...)``) — with
   the block's ``grid`` (small strengths first) and ``range`` — or the method's own under
   ``methods:`` (the subspace merges' α, whose merged update does not add up as summed task
   vectors do). The block's are clipped to the axis's declared range; a method's own are
   searched as given, and refused (exit 2) below the axis's lowest value. A method added to the registry with
   ``sweep_axes`` joins without any change here.
2. **Follow-ups**, once the strength search has had its share of the budget (all but a
   quarter of the candidate evaluations) or has nothing left to try: for the best merge so
   far, (a) its ``density`` (when its method sweeps one), the strength fixed at the best value,
   on the block's ``density`` grid, and (b) a LiNeS schedule ``dghard merge … --lines α,β``
   over that merge (the schedule multiplies the merged update: λ(ℓ) = α + β·ℓ/(L−1) on top of
   the strength found), from the block's ``lines`` pairs, refined by the compass search of the
   ``lines`` family; and (b) for the best merge of every other family within noise of it
   (``FOLLOWUP_NOISE`` HM points, or ``--tie-tolerance``), as many as the reserve gives two
   evaluations each — a family a little behind on strength alone may lead with its schedule;
   and (c) the best merge once more with each of the block's ``calibrate`` post-steps
   (``--calibrate svc``), one evaluation each.
   The follow-ups are chosen from the results alone, so a resumed sweep derives the same ones.

Relies on :mod:`dghard_cli.sweeping.candidates` (entries, kinds) and
:mod:`dghard_cli.sweeping.lines_candidates` (the schedule entry).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dghard_cli.errors import InputError
from dghard_cli.io.checkpoint import Checkpoint
from dghard_cli.methods import registry
from dghard_cli.sweeping.candidates import DEFAULT_TOLERANCE, Candidate, FamilyEntry
from dghard_cli.sweeping.candidates import is_number as _num

BLOCK_KEYS = ("grid", "range", "methods", "exclude", "density", "lines", "calibrate", "tolerance")
#: The keys of one method's own strength search in ``methods:``.
METHOD_KEYS = ("grid", "range")
#: The lines follow-up's (α, β) ranges: shallow layers from 0 to the strength found, the deepest
#: up to 3× it.
LINES_RANGE = {"alpha": (0.0, 1.0), "beta": (0.0, 2.0)}
#: The share of the candidate budget kept for the follow-ups.
FOLLOWUP_SHARE = 4  # a quarter
#: Families whose best HM is within this many points of the best family's get their own LiNeS
#: follow-up (or within ``--tie-tolerance``, if larger): on the real-model merge benchmark the
#: paired standard error of two merges' normalised accuracy is about 1.3 points, and task
#: arithmetic with a schedule matched Iso-C there while TIES, the best strength search on
#: another scenario, took every follow-up and lost by 5.6 HM.
FOLLOWUP_NOISE = 2.0
#: Evaluations a family's schedule follow-up needs at the least (its grid's first two points).
FOLLOWUP_MIN_EVALS = 2


@dataclass
class MergesBlock:
    """The ``merges:`` block of a candidate file."""

    grid: list[float]
    range: tuple[float, float]
    #: a grid and range of their own for methods whose strength has another scale (the subspace
    #: merges' α: their orthogonalised or flat spectra do not add up as summed task vectors do)
    methods: dict[str, tuple[list[float], tuple[float, float]]] = field(default_factory=dict)
    exclude: list[str] = field(default_factory=list)
    density: list[float] = field(default_factory=list)
    lines: list[tuple[float, float]] = field(default_factory=list)
    tolerance: float = DEFAULT_TOLERANCE
    #: post-steps the best merge is tried with (``--calibrate`` values: ``svc``), one evaluation each
    calibrate: list[str] = field(default_factory=list)


def strength_axis(method: registry.MergeMethod) -> str:
    """The axis along which a method's merge gets stronger: ``lambda`` where it is swept, else
    the method's first sweep axis."""
    return "lambda" if "lambda" in method.sweep_axes else method.sweep_axes[0]


def swept_methods(exclude: list[str]) -> list[registry.MergeMethod]:
    """The registered methods the block makes entries of, in registry order."""
    return [
        m
        for m in registry.methods().values()
        if m.sweep_axes and m.fine_tunes != "one" and not m.calibrates and m.name not in exclude
    ]


def _numbers(raw: object, at: str, what: str) -> list[float]:
    if _num(raw):
        raw = [raw]
    if not isinstance(raw, list) or not all(_num(x) for x in raw):
        raise InputError(f"{at}: '{what}' must be a list of numbers")
    return [float(x) for x in raw]


def _grid_and_range(raw: dict, at: str, default: tuple[float, float] | None) -> tuple[list[float], tuple]:
    """A ``grid`` (non-empty) inside a ``range`` [low, high] (``default`` when not given)."""
    grid = _numbers(raw.get("grid"), at, "grid")
    if not grid:
        raise InputError(f"{at}: 'grid' must be a non-empty list of strengths")
    rng = raw.get("range", None if default is None else list(default))
    if not isinstance(rng, list) or len(rng) != 2 or not all(_num(x) for x in rng) or not rng[0] < rng[1]:
        raise InputError(f"{at}: 'range' must be [low, high] with low < high, got {rng!r}")
    lo, hi = float(rng[0]), float(rng[1])
    for g in grid:
        if not lo <= g <= hi:
            raise InputError(f"{at}: grid value {g:g} lies outside range [{lo:g}, {hi:g}]")
    return grid, (lo, hi)


def parse_block(raw: object, where: str) -> MergesBlock:
    """Validate the ``merges:`` block; InputError naming the file and key otherwise."""
    at = f"{where}: merges"
    if not isinstance(raw, dict):
        raise InputError(f"{at}: expected a mapping (keys: {', '.join(BLOCK_KEYS)})")
    for key in raw:
        if key not in BLOCK_KEYS:
            raise InputError(f"{at}: unknown key {key!r} (known keys: {', '.join(BLOCK_KEYS)})")
    grid, (lo, hi) = _grid_and_range(raw, at, None)
    known = [m.name for m in registry.methods().values()]
    own_raw = raw.get("methods", {}) or {}
    if not isinstance(own_raw, dict):
        raise InputError(f"{at}: 'methods' must map a merge method to its own {{grid, range}}")
    own: dict[str, tuple[list[float], tuple[float, float]]] = {}
    for name, spec in own_raw.items():
        if name not in known:
            raise InputError(f"{at}: methods: {name!r} is not a merge method ({', '.join(known)})")
        if not isinstance(spec, dict) or any(k not in METHOD_KEYS for k in spec):
            raise InputError(f"{at}: methods: {name}: expected a mapping with 'grid' and optionally 'range'")
        m = registry.methods()[name]
        if m not in swept_methods([]):
            raise InputError(f"{at}: methods: {name} has no strength the merges block sweeps")
        axis = strength_axis(m)
        declared = m.sweep_range(registry.params()[axis])
        default = (lo, hi) if declared is None else (max(lo, declared[0]), min(hi, declared[1]))
        g, r = _grid_and_range(spec, f"{at}: methods: {name}", default)
        if declared is not None and r[0] < declared[0]:
            # a grid and range of its own are what the user asked for: searched as given (past
            # the declared top, as a family entry's own range), never clipped or dropped; below
            # the declared bottom is a value the method refuses (a negative scale)
            raise InputError(
                f"{at}: methods: {name}: range [{r[0]:g}, {r[1]:g}] reaches below {axis}'s lowest "
                f"value {declared[0]:g}"
            )
        own[name] = (g, r)
    exclude = raw.get("exclude", []) or []
    if not isinstance(exclude, list) or not all(isinstance(x, str) for x in exclude):
        raise InputError(f"{at}: 'exclude' must be a list of merge method names")
    for x in exclude:
        if x not in known:
            raise InputError(f"{at}: exclude {x!r} is not a merge method ({', '.join(known)})")
        if x in own:  # listed to be swept and excluded: it was dropped without a word
            raise InputError(
                f"{at}: {x} is under both 'methods' and 'exclude'; take it out of 'exclude' to sweep it "
                "with its own grid, or out of 'methods' to leave it out"
            )
    density = _numbers(raw.get("density", []) or [], at, "density")
    for d in density:
        if not 0 < d <= 1:
            raise InputError(f"{at}: density {d:g} must be in (0, 1]")
    pairs_raw = raw.get("lines", []) or []
    if not isinstance(pairs_raw, list):
        raise InputError(f"{at}: 'lines' must be a list of [alpha, beta] pairs")
    pairs = []
    for p in pairs_raw:
        if not isinstance(p, list) or len(p) != 2 or not all(_num(x) for x in p):
            raise InputError(f"{at}: lines point {p!r} is not a pair [alpha, beta]")
        a, b = float(p[0]), float(p[1])
        ar, br = LINES_RANGE["alpha"], LINES_RANGE["beta"]
        if not (ar[0] <= a <= ar[1] and br[0] <= b <= br[1]):
            raise InputError(
                f"{at}: lines point [{a:g}, {b:g}] lies outside alpha [{ar[0]:g}, {ar[1]:g}], "
                f"beta [{br[0]:g}, {br[1]:g}]"
            )
        pairs.append((a, b))
    tol = raw.get("tolerance", DEFAULT_TOLERANCE)
    if not _num(tol) or not 0 < float(tol) <= 1:
        raise InputError(f"{at}: 'tolerance' must be a number in (0, 1] (share of the range)")
    calibrate = raw.get("calibrate")
    calibrate = [] if calibrate is None else [calibrate] if isinstance(calibrate, str) else calibrate
    if not isinstance(calibrate, list) or not all(isinstance(x, str) for x in calibrate):
        raise InputError(f"{at}: 'calibrate' must be a list of post-steps (svc)")
    check = registry.params()["calibrate"].check
    for x in calibrate:
        try:
            check(x, registry.methods()["task-arithmetic"], 2)
        except InputError as e:
            raise InputError(f"{at}: calibrate {x!r}: {e}") from None
    return MergesBlock(
        grid, (lo, hi), own, list(exclude), density, pairs, float(tol), list(dict.fromkeys(calibrate))
    )


def block_entries(block: MergesBlock, start: int) -> list[FamilyEntry]:
    """One strength entry per swept method (indices from ``start``), checked when the number of
    fine-tunes is known (a method needing more fine-tunes than given is then skipped)."""
    out: list[FamilyEntry] = []
    par = registry.params()
    for m in swept_methods(block.exclude):
        axis = strength_axis(m)
        if m.name in block.methods:  # its own grid and range, checked by parse_block: as given
            want_grid, (lo, hi) = block.methods[m.name]
        else:  # the block's, clipped to the method's declared range
            want_grid, want = block.grid, block.range
            own = m.sweep_range(par[axis]) or want
            lo, hi = max(want[0], own[0]), min(want[1], own[1])
        if not lo < hi:
            continue  # the method's strength axis does not meet the block's range
        grid = [g for g in want_grid if lo <= g <= hi] or [lo + (hi - lo) / 2]
        out.append(
            FamilyEntry(
                family=m.name,
                grid=grid,
                axis=axis,
                range=(lo, hi),
                log=bool(par[axis].sweep_log) and lo > 0,
                tolerance=block.tolerance,
                fixed={},
                fine_tunes="several",
                index=start + len(out),
                origin="merges",
                followups={
                    "density": list(block.density),
                    "lines": list(block.lines),
                    "calibrate": list(block.calibrate),
                },
            )
        )
    return out


def followup_reserve(entries: list[FamilyEntry], candidate_budget: int) -> int:
    """Evaluations kept for the follow-ups (0 when no entry has any)."""
    if not any(
        e.followups and any(e.followups.get(k) for k in ("density", "lines", "calibrate")) for e in entries
    ):
        return 0
    return candidate_budget // FOLLOWUP_SHARE


def followup_families(
    rows: list[dict], tie_tolerance: float, candidate_budget: int, density_evals: int = 0
) -> list[dict]:
    """The rows whose merges get follow-ups: each family's best row (``objective``, earliest
    ``order`` first among equals), best family first, then — when the best is feasible — the
    other feasible ones within ``max(FOLLOWUP_NOISE, tie_tolerance)`` HM points of it, at most as
    many as the follow-ups' reserve, less the best family's ``density_evals``, gives
    ``FOLLOWUP_MIN_EVALS`` evaluations each (at least the best)."""
    best_of: dict[int, dict] = {}
    for r in rows:
        cur = best_of.get(r["entry"])
        if cur is None or (r["objective"], -r["order"]) > (cur["objective"], -cur["order"]):
            best_of[r["entry"]] = r
    ranked = sorted(best_of.values(), key=lambda r: (r["objective"], -r["order"]), reverse=True)
    if not ranked:
        return []
    top = ranked[0]["objective"]
    if top[0] != 1:  # no feasible merge yet: its second key is a retention, not HM
        return ranked[:1]
    margin = max(FOLLOWUP_NOISE, tie_tolerance)
    near = [r for r in ranked if r["objective"][0] == 1 and r["objective"][1] >= top[1] - margin]
    cap = max(1, (candidate_budget // FOLLOWUP_SHARE - density_evals) // FOLLOWUP_MIN_EVALS)
    return near[:cap]


def density_followup_size(entry: FamilyEntry) -> int:
    """Evaluations the best family's own follow-ups take besides its schedule: its density grid's
    size (where its method sweeps one) and one per calibration post-step."""
    f = entry.followups or {}
    return _density_size(entry) + len(f.get("calibrate") or ())


def _density_size(entry: FamilyEntry) -> int:
    f = entry.followups or {}
    kind = entry.kind
    if (
        not f.get("density")
        or "density" not in kind.axes
        or entry.axis == "density"
        or entry.axis not in kind.fixed
    ):
        return 0
    lo, hi = kind.ranges["density"]
    return len([d for d in f["density"] if lo <= d <= hi])


def followups(
    entry: FamilyEntry,
    cand: Candidate,
    start: int,
    base: Checkpoint,
    ft: Checkpoint,
    *,
    density: bool = True,
) -> tuple[list[FamilyEntry], list[str]]:
    """The follow-up entries of the merge ``cand`` (the best of ``entry``), indices from
    ``start``, and why one was left out (a schedule that cannot bind to the checkpoint);
    ``density``: whether it gets the density follow-up too (the best family only)."""
    from dghard_cli.schedule.bind import checkpoint_depth, schedule_problem
    from dghard_cli.sweeping.lines_candidates import LinesEntry

    out: list[FamilyEntry] = []
    notes: list[str] = []
    f = entry.followups or {}
    kind = entry.kind
    params = dict(cand.params)
    if (
        density
        and f.get("density")
        and "density" in kind.axes
        and entry.axis != "density"
        and entry.axis in kind.fixed
    ):
        lo, hi = kind.ranges["density"]
        grid = [d for d in f["density"] if lo <= d <= hi]
        if grid:
            fixed = {k: (list(v) if isinstance(v, tuple) else v) for k, v in entry.fixed.items()}
            fixed[entry.axis] = cand.value
            out.append(
                FamilyEntry(
                    family=entry.family,
                    grid=grid,
                    axis="density",
                    range=(lo, hi),
                    log=lo > 0,
                    tolerance=entry.tolerance,
                    fixed=fixed,
                    fine_tunes="several",
                    index=start,
                    origin=f"follow-up: density of {cand.label}",
                )
            )
    if f.get("lines"):
        problem = schedule_problem(base, ft)
        if problem is not None:
            notes.append(f"the lines follow-up was skipped: {problem}")
        else:
            out.append(
                LinesEntry(
                    family="lines",
                    grid=list(f["lines"]),  # type: ignore[arg-type]
                    axis="lines",
                    range=LINES_RANGE["alpha"],
                    log=False,
                    tolerance=entry.tolerance,
                    refine=True,
                    fixed={},
                    fine_tunes="several",
                    index=start + len(out),
                    origin=f"follow-up: LiNeS schedule over {cand.label}",
                    alpha_range=LINES_RANGE["alpha"],
                    beta_range=LINES_RANGE["beta"],
                    grid_pairs=list(f["lines"]),
                    num_layers=checkpoint_depth(ft).num_layers,
                    merge_params=tuple(sorted((k, v) for k, v in params.items() if k != "lines")),
                )
            )
    if density:
        for step in f.get("calibrate") or ():
            fixed = {k: (list(v) if isinstance(v, tuple) else v) for k, v in entry.fixed.items()}
            fixed["calibrate"] = step
            out.append(
                FamilyEntry(
                    family=entry.family,
                    grid=[cand.value],
                    axis=entry.axis,
                    range=entry.range,
                    log=entry.log,
                    tolerance=entry.tolerance,
                    refine=False,
                    fixed=fixed,
                    fine_tunes="several",
                    index=start + len(out),
                    origin=f"follow-up: --calibrate {step} of {cand.label}",
                )
            )
    return out, notes
