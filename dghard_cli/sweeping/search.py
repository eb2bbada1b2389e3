"""Where ``dghard sweep`` spends its evaluations: a coarse grid, then golden-section refinement,
in *rounds*.

A round is a list of candidates chosen from what earlier rounds measured, and nothing else: its
candidates can be evaluated one after another or all at once (``--jobs``, a Ray cluster), in any
order of completion, and the next round is the same. So the evaluated set and the winner do not
depend on how many evaluations run at a time, and a resumed sweep (whose earlier results come
from the cache) takes exactly the same steps as one that was never interrupted.

1. **Coarse** (one round): the entries' grid points, round-robin in file order (the first grid
   value of every entry, then the second of every entry, ...), up to ``coarse_allotment``
   evaluations: all of them when they fit in three quarters of the candidate budget, else three
   quarters of it (but at least one point per entry when the budget allows).
2. **Refine** (one round per step): the entry whose best candidate ranks first is refined by one
   golden-section step that probes both neighbours of its best point ``x`` at once: on each side
   of ``x``, between it and the nearest evaluated point (or range end), a probe at 0.382 of that
   side's width (in log coordinates for log axes), rounded to 4 significant digits, the wider
   side first; a side narrower than ``tolerance`` × the range, whose probe rounds onto an
   evaluated value, or whose evaluated neighbour *ties* with ``x`` (the evaluation cannot tell
   them apart: :func:`inside_noise`, the gain of the step could not be resolved), is not
   probed. An entry is done when neither side is; then the next-ranked
   entry is refined. (The ``lines`` family probes every unevaluated compass neighbour of its best
   point at once: :mod:`dghard_cli.sweeping.lines_search`.)
3. When no entry can be refined, the remaining coarse points are one round; the sweep stops
   when the budget is spent or nothing is left. A round larger than the budget left is cut to
   its first candidates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dghard_cli.sweeping import families
from dghard_cli.sweeping.candidates import Candidate, FamilyEntry
from dghard_cli.sweeping.families import make_candidate
from dghard_cli.sweeping.families.base import Objective


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


def refine_probes(entry: FamilyEntry, points: dict[float, Objective]) -> list:
    """The next step on ``entry``'s axis (empty when the entry is done): for a one-axis family a
    golden-section step, a probe on each side of the best point that is still wide enough, the
    wider side first (:class:`~dghard_cli.sweeping.families.base.OneAxisFamily`); for ``lines``
    the compass step.

    ``points`` maps the evaluated axis values of this entry to their objectives.
    """
    return families.refine_probes(entry, points)


def refine_probe(entry: FamilyEntry, points: dict[float, Objective]) -> object | None:
    """The first probe of :func:`refine_probes` (the wider side), or None when the entry is done."""
    probes = refine_probes(entry, points)
    return probes[0] if probes else None


#: ``ties(entry, a, b)``: whether the entry's candidates at axis values ``a`` and ``b`` tie (the
#: evaluation cannot tell them apart: :mod:`dghard_cli.sweeping.compare`).
Ties = Callable[[FamilyEntry, float, float], bool]


def inside_noise(entry: FamilyEntry, points: dict, probe: object, ties: Ties | None) -> bool:
    """Whether a refinement ``probe`` of a one-axis entry lies between its best point and an
    evaluated neighbour that ties with it: the step's gain could not be resolved, so it is not
    taken. A side bounded by the range's end (no neighbour evaluated) is probed as before."""
    if ties is None or not isinstance(probe, float) or not all(isinstance(v, float) for v in points):
        return False
    ok = {v: o for v, o in points.items() if o is not None}
    if not ok:
        return False
    best = max(ok, key=lambda v: (ok[v], -v))  # as the family's refine_probes takes it
    side = [v for v in points if (v - best) * (probe - best) > 0]
    return bool(side) and ties(entry, best, min(side, key=lambda v: abs(v - best)))


def next_round(
    entries: Sequence[FamilyEntry],
    n_fts: int,
    coarse: list[Candidate],
    evaluated: dict[tuple, Objective],
    coarse_done: int,
    allot: int,
    entry_rank: Callable[[FamilyEntry], tuple | None],
    ties: Ties | None = None,
    skipped: set | None = None,
) -> list[tuple[Candidate, str]]:
    """The next round: candidates to evaluate, each with its phase (``coarse`` | ``refine``);
    empty when the search is done.

    ``evaluated`` maps a candidate's ``params`` to its objective; ``entry_rank`` gives an
    entry's best objective (None when it has no successful candidate); ``ties``: a refinement
    probe :func:`inside_noise` is not taken (added to ``skipped`` as (entry index, probe)). The
    caller cuts a round to the budget it has left.
    """
    pending = [c for c in coarse if c.params not in evaluated]
    if coarse_done < allot and pending:
        return [(c, "coarse") for c in pending[: allot - coarse_done]]
    ranked = [e for e in entries if entry_rank(e) is not None]
    ranked.sort(key=lambda e: entry_rank(e), reverse=True)  # type: ignore[arg-type, return-value]
    for e in ranked:
        pts = entry_points(e, n_fts, coarse, evaluated)
        step: list[tuple[Candidate, str]] = []
        for probe in refine_probes(e, pts):
            if inside_noise(e, pts, probe, ties):
                if skipped is not None:
                    skipped.add((e.index, probe))
                continue
            cand = make_candidate(e, probe, n_fts=n_fts)
            if cand.params not in evaluated and all(cand.params != c.params for c, _ in step):
                step.append((cand, "refine"))
        if step:
            return step
    return [(c, "coarse") for c in pending]


def entry_points(
    entry: FamilyEntry, n_fts: int, coarse: list[Candidate], evaluated: dict[tuple, Objective]
) -> dict[float, Objective]:
    """The evaluated axis values of ``entry`` and their objectives."""
    return families.entry_points(entry, n_fts, coarse, evaluated)
