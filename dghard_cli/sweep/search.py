"""Where ``dghard sweep`` spends its evaluations: a coarse grid, then golden-section refinement.

Pure functions of what has been evaluated so far, so a resumed sweep (whose earlier results
come from the cache) takes exactly the same steps as one that was never interrupted.

1. **Coarse**: the entries' grid points, round-robin in file order (the first grid value of
   every entry, then the second of every entry, ...), up to ``coarse_allotment`` evaluations:
   all of them when they fit in three quarters of the candidate budget, else three quarters
   of it (but at least one point per entry when the budget allows).
2. **Refine**: the entry whose best candidate ranks first is refined by one golden-section
   step: around its best point ``x`` and the nearest evaluated points (or range ends) on
   either side, the next probe goes into the wider side at 0.382 of its width (in log
   coordinates for log axes), rounded to 4 significant digits. An entry is done when its
   wider side is narrower than ``tolerance`` × the range, or the probe rounds onto an
   evaluated value; then the next-ranked entry is refined.
3. When no entry can be refined, the remaining coarse points are evaluated; the sweep stops
   when the budget is spent or nothing is left.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from dghard_cli.sweep.candidates import Candidate, FamilyEntry, round_sig
from dghard_cli.sweep.family_dispatch import make_candidate

#: 2 − φ: where golden-section search puts its next probe inside the wider side.
GOLDEN = (3.0 - math.sqrt(5.0)) / 2.0

#: An objective is any comparable tuple (larger is better); None for a candidate that failed.
Objective = tuple | None


def coarse_order(entries: Sequence[FamilyEntry], n_fts: int) -> list[Candidate]:
    """Grid points round-robin across entries (duplicates within an entry dropped)."""
    out: list[Candidate] = []
    seen: set = set()
    depth = max((len(e.grid) for e in entries), default=0)
    for k in range(depth):
        for e in entries:
            if k < len(e.grid):
                c = make_candidate(e, e.grid[k], n_fts=n_fts)
                if c.params not in seen:
                    seen.add(c.params)
                    out.append(c)
    return out


def coarse_allotment(candidate_budget: int, n_coarse: int, n_entries: int) -> int:
    """How many coarse points are evaluated before refinement starts."""
    share = candidate_budget - candidate_budget // 4
    return min(n_coarse, candidate_budget, max(share, min(n_entries, candidate_budget)))


def refine_probe(entry: FamilyEntry, points: dict[float, Objective]) -> float | None:
    """The next golden-section probe on ``entry``'s axis, or None when it is done.

    ``points`` maps the evaluated axis values of this entry to their objectives.
    """
    if entry.family == "lines":  # two axes: a compass search (sweep/lines.py)
        from dghard_cli.sweep import lines

        return lines.refine_probe(entry, points)  # type: ignore[arg-type, return-value]
    if not entry.refine:
        return None
    ok = {v: o for v, o in points.items() if o is not None}
    if not ok:
        return None
    best = max(ok, key=lambda v: (ok[v], -v))  # equal objectives: the smallest value
    xs = sorted(points)
    i = xs.index(best)
    u = entry.coord(best)
    left = entry.coord(xs[i - 1]) if i > 0 else entry.coord(entry.lo)
    right = entry.coord(xs[i + 1]) if i + 1 < len(xs) else entry.coord(entry.hi)
    wl, wr = u - left, right - u
    span = entry.coord(entry.hi) - entry.coord(entry.lo)
    if max(wl, wr) < entry.tolerance * span:
        return None
    probe_u = u + GOLDEN * wr if wr >= wl else u - GOLDEN * wl
    probe = round_sig(entry.value(probe_u))
    probe = min(max(probe, entry.lo), entry.hi)
    if probe in points or probe == best:
        return None
    return probe


def next_candidate(
    entries: Sequence[FamilyEntry],
    n_fts: int,
    coarse: list[Candidate],
    evaluated: dict[tuple, Objective],
    coarse_done: int,
    allot: int,
    entry_rank: Callable[[FamilyEntry], tuple | None],
) -> tuple[Candidate, str] | None:
    """The next candidate to evaluate and its phase (``coarse`` | ``refine``), or None.

    ``evaluated`` maps a candidate's ``params`` to its objective; ``entry_rank`` gives an
    entry's best objective (None when it has no successful candidate).
    """
    pending = [c for c in coarse if c.params not in evaluated]
    if coarse_done < allot and pending:
        return pending[0], "coarse"
    ranked = [e for e in entries if entry_rank(e) is not None]
    ranked.sort(key=lambda e: entry_rank(e), reverse=True)  # type: ignore[arg-type, return-value]
    for e in ranked:
        pts = entry_points(e, n_fts, coarse, evaluated)
        probe = refine_probe(e, pts)
        if probe is not None:
            cand = make_candidate(e, probe, n_fts=n_fts)
            if cand.params not in evaluated:
                return cand, "refine"
    if pending:
        return pending[0], "coarse"
    return None


def entry_points(
    entry: FamilyEntry, n_fts: int, coarse: list[Candidate], evaluated: dict[tuple, Objective]
) -> dict[float, Objective]:
    """The evaluated axis values of ``entry`` and their objectives."""
    if entry.family == "lines":
        from dghard_cli.sweep import lines

        return lines.entry_points(entry, evaluated)  # type: ignore[arg-type, return-value]
    # the entry's own grid and every value refinement produced are candidates of this entry;
    # they are found by regenerating the candidate of each evaluated value of the axis
    out: dict[float, Objective] = {}
    for params, obj in evaluated.items():
        d = dict(params)
        v = d.get(entry.axis)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        if make_candidate(entry, float(v), n_fts=n_fts).params == params:
            out[float(v)] = obj
    return out
