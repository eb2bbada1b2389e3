"""Standard errors of % repair, % retention and HM, from the benchmarks' standard errors.

% repair and % retention are means of per-benchmark ratios of the candidate's, the base's and
the fine-tune's scores (:func:`dghard_cli.scoring.metrics.score_one`); HM combines the two. Each
is a smooth function of those scores, so its standard error follows from theirs by the delta
method: ``se(g)² = Σ (∂g/∂x)²·se(x)²`` over every score ``x`` it uses. The three evaluations are
taken as independent. On one benchmark's items they are positively correlated in practice
(a candidate close to the fine-tune gets most items the fine-tune gets), so a difference such
as ``c − f`` varies less than this assumes: the standard errors here err on the large side.

% repair and % retention use disjoint benchmarks (each is in one partition), so they are
independent and HM's variance is ``(∂HM/∂R)²·se(R)² + (∂HM/∂T)²·se(T)²``. Where HM is the
smaller of the two (one of them ≤ 0, see the metrics' docstring) its derivative is that one's;
at a tie the larger standard error is taken. A score whose standard error the results do not
give makes every mean that uses it, and HM, ``None`` (unknown, not zero).

``docs/score.md`` states this; ``tests/test_score_uncertainty.py`` checks it against a
simulation of benchmarks with known item counts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from dghard_cli.scoring.results import Score


def _partials(part: str, c: float, b: float, f: float, in_repair_unchanged: bool) -> dict[str, float]:
    """∂(per-benchmark value)/∂(c, b, f), in the units of the value (% of the gap, or %)."""
    if part == "damaged":  # r = (c − f)/(b − f)·100
        g = b - f
        return {"c": 100.0 / g, "b": -100.0 * (c - f) / g**2, "f": 100.0 * (c - b) / g**2}
    if part in ("improved", "target"):  # t = (c − b)/(f − b)·100
        g = f - b
        return {"c": 100.0 / g, "b": 100.0 * (c - f) / g**2, "f": -100.0 * (c - b) / g**2}
    if part == "unchanged" and in_repair_unchanged:  # c/b·100
        return {"c": 100.0 / b, "b": -100.0 * c / b**2, "f": 0.0}
    return {}


def _mean_stderr(terms: Sequence[tuple[dict[str, float], dict[str, float | None]]]) -> float | None:
    """se of the mean of per-benchmark values, from each value's partials and its scores' ses."""
    if not terms:
        return None
    var = 0.0
    for partial, ses in terms:
        for role, d in partial.items():
            if d == 0.0:
                continue
            se = ses[role]
            if se is None:
                return None
            var += (d * se) ** 2
    return math.sqrt(var) / len(terms)


def hm_partials(repair: float | None, retention: float | None) -> tuple[float, float]:
    """(∂HM/∂R, ∂HM/∂T) at (R, T), for the HM of :func:`metrics.harmonic_mean` (a missing one: 0)."""
    if repair is None:
        return 0.0, 1.0
    if retention is None:
        return 1.0, 0.0
    if repair > 0 and retention > 0:
        s = (repair + retention) ** 2
        return 2.0 * retention**2 / s, 2.0 * repair**2 / s
    if repair == retention:
        return 0.5, 0.5  # a tie of the min: replaced by the larger se below
    return (1.0, 0.0) if repair < retention else (0.0, 1.0)


def uncertainty(
    c: Mapping[str, Score],
    benchmarks: Sequence[dict],
    repair: float | None,
    retention: float | None,
    *,
    targets_in_retention: bool = False,
    unchanged_in_repair: bool = False,
) -> dict[str, float | None]:
    """``repair_stderr``, ``retention_stderr`` and ``hm_stderr`` of one candidate (None where
    undefined or where a score they use has no standard error)."""
    rep: list[tuple[dict[str, float], dict[str, float | None]]] = []
    ret: list[tuple[dict[str, float], dict[str, float | None]]] = []
    for bm in benchmarks:
        part, k = bm["partition"], bm["name"]
        b, f, cv = bm["base"], bm["ft"], c[k].value
        ses = {"c": c[k].stderr, "b": bm["base_stderr"], "f": bm["ft_stderr"]}
        if part == "damaged":
            rep.append((_partials(part, cv, b, f, False), ses))
        elif part == "improved" or (part == "target" and targets_in_retention and f != b):
            ret.append((_partials(part, cv, b, f, False), ses))
        elif part == "unchanged" and unchanged_in_repair and b > 0:
            rep.append((_partials(part, cv, b, f, True), ses))
    se_r = _mean_stderr(rep) if repair is not None else None
    se_t = _mean_stderr(ret) if retention is not None else None
    unknown = (repair is not None and se_r is None) or (retention is not None and se_t is None)
    if (repair is None and retention is None) or unknown:
        se_hm = None
    else:
        d_r, d_t = hm_partials(repair, retention)
        if d_r == d_t == 0.5:  # HM = min(R, T) at a tie: the larger of the two
            se_hm = max(se_r or 0.0, se_t or 0.0)
        else:
            se_hm = math.sqrt((d_r * (se_r or 0.0)) ** 2 + (d_t * (se_t or 0.0)) ** 2)
    return {"repair_stderr": se_r, "retention_stderr": se_t, "hm_stderr": se_hm}
