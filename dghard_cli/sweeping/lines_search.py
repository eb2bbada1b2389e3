"""The refinement search of the ``lines`` sweep family: a compass search around the best (α, β)
so far, then (with ``--refine groups``) the same search over per-group offsets, and the
evaluated points of an entry recovered from the sweep's evaluations (so a resumed sweep takes
the same steps).

Relies on :mod:`dghard_cli.sweeping.lines_candidates` (group points, block ranges, the candidate
a point makes). :mod:`dghard_cli.sweeping.lines` is the public entry.
"""

from __future__ import annotations

from collections.abc import Sequence

from dghard_cli.errors import InputError
from dghard_cli.sweeping.candidates import round_sig
from dghard_cli.sweeping.lines_candidates import GroupPoint, LinesEntry, _make, group_ranges

Objective = tuple | None

# -- the search ---------------------------------------------------------------------------------


def compass_probes(
    points: dict[tuple[float, ...], Objective],
    lo: Sequence[float],
    hi: Sequence[float],
    step: float,
    tolerance: float,
) -> list[tuple[float, ...]]:
    """One step of a compass search around the best of ``points``: every unevaluated neighbour
    at the current step, in order (empty when done).

    Steps are shares of each coordinate's range ``hi − lo``: the first step is the Chebyshev
    distance (in those shares) from the best point to the nearest other evaluated point, at
    most ``step``; coordinates in order, + before −; the step halves when every neighbour at
    it is evaluated; below ``tolerance`` the search is done.
    """
    ok = {p: o for p, o in points.items() if o is not None}
    if not ok:
        return []
    best = max(ok, key=lambda p: (ok[p], tuple(-x for x in p)))  # equal objectives: the smallest point
    span = [h - low for low, h in zip(lo, hi, strict=True)]
    dist = [max(abs(q[d] - best[d]) / span[d] for d in range(len(best))) for q in points if q != best]
    s = round_sig(min([step, *[x for x in dist if x > 0]]))
    while s >= tolerance:
        out: list[tuple[float, ...]] = []
        for d in range(len(best)):
            for sign in (1.0, -1.0):
                # round(…, 12) first: 0.1 − 0.1·(1 − 2⁻⁵⁴) is 0, not 2.8e-17
                v = min(max(round_sig(round(best[d] + sign * s * span[d], 12)), lo[d]), hi[d])
                q = (*best[:d], v, *best[d + 1 :])
                if q != best and q not in points and q not in out:
                    out.append(q)
        if out:
            return out
        s /= 2
    return []


def compass_probe(
    points: dict[tuple[float, ...], Objective],
    lo: Sequence[float],
    hi: Sequence[float],
    step: float,
    tolerance: float,
) -> tuple[float, ...] | None:
    """The first probe of :func:`compass_probes`, or None when the search is done."""
    probes = compass_probes(points, lo, hi, step, tolerance)
    return probes[0] if probes else None


def refine_probes(entry: LinesEntry, points: dict[object, Objective]) -> list:
    """The next refinement step of a ``lines`` entry: (α, β) neighbours, then (with --refine
    groups) :class:`GroupPoint` neighbours; empty when both stages are done."""
    if not entry.refine:
        return []
    pairs = {p: o for p, o in points.items() if isinstance(p, tuple)}
    lo = (entry.alpha_range[0], entry.beta_range[0])
    hi = (entry.alpha_range[1], entry.beta_range[1])
    probes = compass_probes(pairs, lo, hi, entry.step, entry.tolerance)  # type: ignore[arg-type]
    if probes:
        return probes
    if not entry.refine_groups or entry.num_layers is None:
        return []
    ok = {p: o for p, o in pairs.items() if o is not None}
    if not ok:
        return []
    best = max(ok, key=lambda p: (ok[p], tuple(-x for x in p)))
    n = len(group_ranges(entry.num_layers, entry.groups)) + 2
    offsets: dict[tuple[float, ...], Objective] = {(0.0,) * n: ok[best]}
    for p, o in points.items():
        if isinstance(p, GroupPoint) and p.base == best and len(p.offsets) == n:
            offsets[p.offsets] = o
    glo, ghi = [entry.group_range[0]] * n, [entry.group_range[1]] * n
    steps = compass_probes(offsets, glo, ghi, entry.step, entry.tolerance)
    return [GroupPoint(base=best, offsets=q) for q in steps]  # type: ignore[arg-type]


def refine_probe(entry: LinesEntry, points: dict[object, Objective]) -> object | None:
    """The first probe of :func:`refine_probes`, or None when both stages are done."""
    probes = refine_probes(entry, points)
    return probes[0] if probes else None


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
