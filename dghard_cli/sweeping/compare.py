"""Every candidate compared with the best one so far (the *incumbent*), and its place in the
declared prior: what :func:`dghard_cli.sweeping.choose.choose_winner` reads to tell a win from
noise.

A sweep evaluates many candidates on one small evaluation; the best observed score is the
best candidate plus the luckiest noise. Each row gets its objective minus the incumbent's
(``vs_best``) and the standard error of that difference (``vs_best_stderr``): item by item
where the evaluation gives per-item results (lm-eval's ``--log_samples``; an ``items`` list in
the results JSON), so the candidates' shared items cancel, from the benchmarks' stderrs
otherwise (:func:`dghard_cli.scoring.metrics.differences`). Candidates within ``--tie-rule``
standard errors of the incumbent tie with it, and the prior (``prior``: the data-free default
first, then the middle of the widest plateau) picks among them, not the highest number."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dghard_cli.scoring.metrics import differences
from dghard_cli.spectral.spectrum import ShrinkSpec
from dghard_cli.sweeping.candidates import FamilyEntry
from dghard_cli.sweeping.choose import OBJECTIVE_LABELS, OBJECTIVES, incumbent
from dghard_cli.sweeping.families.shrinkers import spec_params
from dghard_cli.sweeping.state import SweepState


def is_data_free_default(row: dict) -> bool:
    """Whether ``row`` is what bare ``dghard repair BASE FT OUT`` writes (its default filter)."""
    default = ShrinkSpec()
    return (
        row["command"] == "repair"
        and row["family"] == default.shrink
        and row["params"] == spec_params(default)
    )


def prior(row: dict) -> list:
    """``row``'s mark for :data:`dghard_cli.sweeping.choose.PRIOR`: [0] for the data-free default."""
    return [int(not is_data_free_default(row))]


def compare_with_best(s: SweepState, named: Sequence[tuple[str, object]]) -> None:
    """Fill ``vs_best``, ``vs_best_stderr``, ``vs_best_paired`` and ``prior`` of every row;
    ``named`` is the list :func:`dghard_cli.scoring.metrics.score_candidates` scored."""
    best = incumbent(s.rows, s.opts.objective)
    measure = OBJECTIVES[s.opts.objective]
    diffs: dict[str, dict] = {}
    ft = s.ft_rfs[0] if len(s.ft_rfs) == 1 else s.expert_ref
    s.compared = (ft, list(named))
    if best is not None and s.score_doc is not None:
        diffs = differences(s.base_rf, ft, list(named), s.score_doc, best["name"], measure)  # type: ignore[arg-type]
    for r in s.rows:
        d = diffs.get(r["name"]) if r["status"] == "ok" else None
        r["vs_best"] = None if d is None else d["diff"]
        r["vs_best_stderr"] = None if d is None else d["diff_stderr"]
        r["vs_best_paired"] = bool(d and d["paired"])
        r["prior"] = prior(r)


#: A sweep whose evaluation cannot resolve differences of this many points of its objective
#: says so before its first candidate.
RESOLUTION_WARN_POINTS = 10.0


def resolution(s: SweepState) -> float | None:
    """The smallest difference of the objective the evaluation resolves, estimated from BASE's
    and FT's results alone (before any candidate): two standard errors of the difference
    between two candidates halfway between them on every benchmark, each with the mean of
    BASE's and FT's variance, unpaired (per-item results pair candidates and resolve smaller
    differences). None: a standard error is unknown, or the objective is undefined."""
    from dghard_cli.scoring.metrics import Rules, score_one
    from dghard_cli.scoring.results import Score
    from dghard_cli.scoring.uncertainty import measure_gradient

    doc = s.score_doc
    if doc is None:
        return None
    mid: dict[str, Score] = {}
    for bm in doc["benchmarks"]:
        ses = (bm.get("base_stderr"), bm.get("ft_stderr"))
        se = None if None in ses else ((ses[0] ** 2 + ses[1] ** 2) / 2) ** 0.5
        mid[bm["name"]] = Score((bm["base"] + bm["ft"]) / 2, se)
    rules = Rules(bool(doc.get("retention_includes_targets")), bool(doc.get("unchanged_in_repair")))
    measure = OBJECTIVES[s.opts.objective]
    cd = score_one("halfway", "", mid, doc["benchmarks"], rules)
    if cd[measure] is None:
        return None
    grad = measure_gradient(
        measure,
        mid,
        doc["benchmarks"],
        cd["repair"],
        cd["retention"],
        targets_in_retention=rules.targets_in_retention,
        unchanged_in_repair=rules.unchanged_in_repair,
    )
    var = 0.0
    for k, g in grad.items():
        d = g.get("c", 0.0)
        if d == 0.0:
            continue
        se = mid[k].stderr
        if se is None:
            return None
        var += 2.0 * (d * se) ** 2
    return 2.0 * var**0.5


def warn_resolution(s: SweepState) -> None:
    """Record the evaluation's resolution (``s.resolution``) and warn, in one line, when it is
    coarse: more candidates then mostly find noise."""
    s.resolution = resolution(s)
    if s.resolution is not None and s.resolution >= RESOLUTION_WARN_POINTS:
        label = OBJECTIVE_LABELS[s.opts.objective]
        msg = (
            f"this evaluation resolves about ±{s.resolution:.0f} {label} points (two standard errors of a "
            "difference between two candidates, from BASE's and FT's stderrs): candidates closer than that "
            "tie, and more items, not more candidates, will help"
        )
        if msg not in s.warnings:
            s.warnings.append(msg)
        s.emit(kind="info", message=f"warning: {msg}")


def ties(s: SweepState) -> Callable[[FamilyEntry, float, float], bool]:
    """Whether two evaluated candidates of one entry, at axis values ``a`` and ``b``, tie: their
    objectives differ by at most ``--tie-rule`` standard errors of their (paired) difference, or
    by ``--tie-tolerance`` points. Unknown noise, or a rule of 0 with no tolerance: never."""
    measure = OBJECTIVES[s.opts.objective]
    memo: dict[str, dict] = {}

    def at(entry: FamilyEntry, value: float) -> dict | None:
        return next(
            (r for r in s.rows if r["entry"] == entry.index and r["value"] == value and r["status"] == "ok"),
            None,
        )

    def tie(entry: FamilyEntry, a: float, b: float) -> bool:
        ra, rb = at(entry, a), at(entry, b)
        if ra is None or rb is None or ra[measure] is None or rb[measure] is None or s.score_doc is None:
            return False
        if not (ra["feasible"] and rb["feasible"]):  # refinement toward the target bar: not HM's noise
            return False
        gap = abs(ra[measure] - rb[measure])
        if gap <= s.opts.tie_tolerance:
            return True
        if s.opts.tie_rule <= 0 or s.compared is None:
            return False
        if ra["name"] not in memo:
            ft, named = s.compared
            memo[ra["name"]] = differences(s.base_rf, ft, named, s.score_doc, ra["name"], measure)  # type: ignore[arg-type]
        se = memo[ra["name"]].get(rb["name"], {}).get("diff_stderr")
        return se is not None and gap <= s.opts.tie_rule * se

    return tie
