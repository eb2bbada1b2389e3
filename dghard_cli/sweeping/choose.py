"""Choosing among scored candidates: feasibility (every target keeps enough of the fine-tune's
gain), the objective (HM by default), closeness to the fine-tune; and the distance that measures
that closeness."""

from __future__ import annotations

import math

import numpy as np
import torch

from dghard_cli.io.checkpoint import Checkpoint

#: ``--objective``: what the sweep maximises, and the score field (of ``dghard score``) it reads.
OBJECTIVES = {"hm": "hm", "retention": "retention", "normalised-accuracy": "normalised_accuracy"}

#: How each objective is named in messages.
OBJECTIVE_LABELS = {"hm": "HM", "retention": "% retention", "normalised-accuracy": "normalised accuracy"}

#: Row blocks of the distance computation (float64 bytes per input block).
DISTANCE_BLOCK_BYTES = 64 * 1024 * 1024


def _sq(x: torch.Tensor) -> float:
    """Σ x² in float64 with numpy's pairwise summation, whose order depends on the length alone:
    torch's reduction gave another last bit in a Ray worker process than in the sweep's own, and
    the distance breaks ties."""
    a = x.detach().cpu().numpy().ravel()
    return float(np.sum(a * a))


def update_distance(base: Checkpoint, fts: list[Checkpoint], cand: Checkpoint) -> float:
    """‖W_c − W_ref‖ / ‖W_ref − W_base‖ over all floating tensors (float64, row blocks), to 12
    significant digits.

    W_ref is the fine-tune (several: W_base + Σ_i (W_i − W_base)). Tensors whose shape differs
    from BASE's (a resized vocabulary) compare with the first fine-tune and add nothing to
    the denominator.
    """
    num = den = 0.0
    for name, info in cand.tensors.items():
        if not info.is_float:
            continue
        ft_infos = [f.tensors.get(name) for f in fts]
        if any(t is None or not t.is_float for t in ft_infos):
            continue
        b = base.tensors.get(name)
        same = b is not None and b.is_float and all(t.shape == b.shape == info.shape for t in ft_infos)
        rows = info.shape[0] if info.shape else 0
        width = max(1, info.numel // rows) if rows else 1
        step = max(1, DISTANCE_BLOCK_BYTES // (8 * width))
        spans = [(r, min(rows, r + step)) for r in range(0, rows, step)] if rows else [None]
        for span in spans:
            c = info.read(span).to(torch.float64)
            if not same:
                f0 = ft_infos[0]
                if f0.shape != info.shape:
                    continue
                num += _sq(c - f0.read(span).to(torch.float64))
                continue
            bb = b.read(span).to(torch.float64)
            if len(fts) == 1:
                ref = ft_infos[0].read(span).to(torch.float64)
            else:
                ref = bb.clone()
                for t in ft_infos:
                    ref += t.read(span).to(torch.float64) - bb
            num += _sq(c - ref)
            den += _sq(ref - bb)
    if den <= 0:
        return 0.0 if num <= 0 else math.inf
    # 12 significant digits: a last-bit difference between two machines' arithmetic (a Ray
    # worker's CPU) cannot reorder a tie
    return float(f"{math.sqrt(num / den):.12g}")


def target_ok(cd: dict, min_retention: float | None) -> bool:
    """Every target whose retention is defined keeps at least ``min_retention`` % (None: no bar)."""
    if min_retention is None:
        return True
    return all(v is None or v >= min_retention for v in cd["target_retention"].values())


def objective(
    cd: dict | None, distance: float, min_retention: float | None, measure: str = "hm"
) -> tuple | None:
    """What the search maximises: feasible first, then the ``measure`` (a key of
    :data:`OBJECTIVES`; infeasible: the worst target's retention, so refinement moves toward
    feasibility), then closeness to the fine-tune."""
    if cd is None:
        return None
    value = cd[OBJECTIVES[measure]]
    if value is None:
        return (-1, 0.0, -distance)
    if target_ok(cd, min_retention):
        return (1, value, -distance)
    worst = min((v for v in cd["target_retention"].values() if v is not None), default=-math.inf)
    return (0, worst, -distance)


#: ``--tie-rule`` default: a candidate whose objective is within this many standard errors of
#: its paired difference from the best ties with the best (tests/test_sweep_noise.py chose it).
DEFAULT_TIE_RULE = 2.0

#: The declared prior that picks the winner from the tie set, in order (the report and
#: docs/sweep.md state it). The best observed score is the best candidate plus the luckiest
#: noise; the middle of the widest plateau is not.
PRIOR = (
    "the data-free default (what bare `dghard repair` writes), if it ties",
    "else the family (candidate-file entry) with the most candidates in the tie set (then the best's)",
    "and of its tied candidates the middle one by distance to the fine-tune (of two, the farther)",
)


def tie_margin(row: dict, tie_tolerance: float, tie_rule: float) -> float:
    """How far below the best a candidate may be and still tie with it: ``tie_rule`` standard
    errors of its paired difference from the best (``vs_best_stderr``; unknown: none), or
    ``tie_tolerance`` points, whichever is larger."""
    se = row.get("vs_best_stderr")
    return max(tie_tolerance, tie_rule * se if se is not None and math.isfinite(se) else 0.0)


def incumbent(rows: list[dict], measure: str = "hm") -> dict | None:
    """The feasible candidate with the best ``measure`` (the first evaluated on an exact tie): the
    one every other is compared with, item by item where the results allow."""
    key = OBJECTIVES[measure]
    return max(_qualifying(rows, key), key=lambda r: (r[key], -r["order"]), default=None)


def _qualifying(rows: list[dict], key: str) -> list[dict]:
    """The rows evaluated, with the objective ``key`` defined, that meet the target bar."""
    return [r for r in rows if r["status"] == "ok" and r[key] is not None and r["feasible"]]


def by_prior(tied: list[dict]) -> dict:
    """The member of the tie set (best first, non-empty) that :data:`PRIOR` ranks first."""
    for r in tied:
        if (r.get("prior") or [1])[0] == 0:
            return r
    count: dict[int, int] = {}
    for r in tied:
        count[r["entry"]] = count.get(r["entry"], 0) + 1
    entry = max(count, key=lambda e: (count[e], e == tied[0]["entry"], -e))
    members = sorted((r for r in tied if r["entry"] == entry), key=lambda r: (r["distance"], r["order"]))
    return members[len(members) // 2]


def tie_set(
    rows: list[dict],
    min_retention: float | None,
    tie_tolerance: float,
    measure: str = "hm",
    tie_rule: float = 0.0,
) -> list[dict]:
    """The feasible candidates that tie with the best (:func:`tie_margin`), best first."""
    key = OBJECTIVES[measure]
    best = incumbent(rows, measure)
    if best is None:
        return []
    tied = [r for r in _qualifying(rows, key) if r[key] >= best[key] - tie_margin(r, tie_tolerance, tie_rule)]
    return sorted(tied, key=lambda r: (-r[key], r["order"]))


def choose_winner(
    rows: list[dict],
    min_retention: float | None,
    tie_tolerance: float,
    measure: str = "hm",
    tie_rule: float = 0.0,
) -> tuple[dict | None, str | None]:
    """The winner among scored candidate rows (the ``measure``'s field, ``feasible``,
    ``distance``, ``order``, and where the sweep compared them ``vs_best_stderr`` and
    ``prior``): of the candidates that tie with the best (:func:`tie_set`), the first by the
    declared prior (:func:`by_prior`). ``tie_rule`` 0 is the earlier rule: of the candidates
    within ``tie_tolerance`` of the best, the closest to the fine-tune."""
    key = OBJECTIVES[measure]
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return None, "no candidate could be evaluated (see each candidate's status and message)"
    defined = [r for r in ok if r[key] is not None]
    if not defined:
        if measure == "normalised-accuracy":
            return None, (
                "normalised accuracy is undefined for every candidate (no improved benchmark or target "
                "scored above 0 by the fine-tune, in bounded units)"
            )
        if measure == "retention":
            return None, "% retention is undefined for every candidate (no improved benchmarks)"
        return None, "HM is undefined for every candidate (no damaged and no improved benchmarks)"
    feasible = [r for r in defined if r["feasible"]]
    if not feasible:
        return None, (
            f"no candidate keeps at least {min_retention:g} % of the fine-tune's gain on every target "
            "(--min-target-retention)"
        )
    tied = tie_set(rows, min_retention, tie_tolerance, measure, tie_rule)
    if tie_rule <= 0:  # the earlier rule, unchanged: of the tied, the closest to the fine-tune
        return min(tied, key=lambda r: (r["distance"], r["order"])), None
    return by_prior(tied), None


def explain_choice(
    rows: list[dict],
    winner: dict,
    min_retention: float | None,
    tie_tolerance: float,
    measure: str = "hm",
    tie_rule: float = 0.0,
) -> dict:
    """Why ``winner`` won: the best candidate, the tie set (names, best first), the rule, the
    prior, and one sentence."""
    key, label = OBJECTIVES[measure], OBJECTIVE_LABELS[measure]
    tied = tie_set(rows, min_retention, tie_tolerance, measure, tie_rule)
    best = tied[0] if tied else winner
    rule = (
        f"{tie_rule:g} standard error(s) of their paired difference from it"
        if tie_rule > 0
        else "no noise rule"
    )
    others = [r for r in rows if r is not best and r["status"] == "ok" and r.get(key) is not None]
    if tie_rule > 0 and others and all(r.get("vs_best_stderr") is None for r in others):
        rule = "the results give no standard errors: only exact ties count"
    if tie_tolerance > 0:
        rule += f", or within {tie_tolerance:g} points (--tie-tolerance)"
    if len(tied) <= 1:
        why = f"the best {label} ({winner[key]:.2f}); no other candidate ties with it ({rule})"
    elif winner is best:
        why = (
            f"the best {label} ({best[key]:.2f}), and first by the declared prior among the {len(tied)} "
            f"candidates that tie with it ({rule})"
        )
    else:
        why = (
            f"{len(tied)} candidates tie with the best, {best['name']!r} ({label} {best[key]:.2f}) "
            f"({rule}): differences the evaluation cannot resolve; {winner['name']!r} ({winner[key]:.2f}) "
            "is first by the declared prior"
        )
    return {
        "best": best["name"],
        "tie_set": [r["name"] for r in tied],
        "tie_rule": tie_rule,
        "tie_tolerance": tie_tolerance,
        "prior": list(PRIOR),
        "reason": why,
    }
