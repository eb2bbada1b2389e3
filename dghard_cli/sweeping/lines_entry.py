"""A ``lines`` entry of the sweep's candidate file: its keys checked (the (α, β) grid, the
ranges, step and tolerance, ``fixed`` spectral parameters, the per-group settings), every
candidate it may produce checked up front, and the entries bound to FT's number of layers
(or skipped, with the reason, where FT cannot take a schedule).

Relies on :mod:`dghard_cli.sweeping.lines_candidates` (the entry type and its candidates) and on
:mod:`dghard_cli.schedule.bind` (whether and how deep a schedule binds to FT).
:mod:`dghard_cli.sweeping.lines` is the public entry.
"""

from __future__ import annotations

from dghard_cli.errors import InputError
from dghard_cli.io.checkpoint import Checkpoint
from dghard_cli.schedule.bind import checkpoint_depth, schedule_problem
from dghard_cli.sweeping.candidates import DEFAULT_TOLERANCE, FamilyEntry
from dghard_cli.sweeping.candidates import is_number as _num
from dghard_cli.sweeping.lines_candidates import (
    DEFAULT_GROUP_RANGE,
    DEFAULT_GROUPS,
    DEFAULT_RANGE,
    DEFAULT_STEP,
    FAMILY,
    LinesEntry,
    make_candidate,
)

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
SPECTRAL_KEYS = ("shrink", "scale", "noise", "sigma", "a", "b")

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
