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


Cov = dict[tuple[str, str], float]


def _item_cov(series: Mapping[str, Sequence[float]]) -> Cov:
    """Covariances of the three scores (means over the same n items): cov(x_i, x_j)/n, the
    sample covariance of the per-item values (n − 1 in its denominator) over n."""
    n = len(next(iter(series.values())))
    means = {r: math.fsum(xs) / n for r, xs in series.items()}
    out: Cov = {}
    for r1 in series:
        for r2 in series:
            d = math.fsum(
                (a - means[r1]) * (b - means[r2]) for a, b in zip(series[r1], series[r2], strict=True)
            )
            out[r1, r2] = d / (n - 1) / n
    return out


def score_cov(c: Score, b: Score, f: Score) -> Cov | None:
    """The covariance of one benchmark's candidate, base and fine-tune scores: from their items
    where all three list the same number of them (the same items, in the same order), else the
    diagonal of their standard errors (independent); None where a standard error is unknown."""
    if c.items and b.items and f.items and len(c.items) == len(b.items) == len(f.items) >= 2:
        return _item_cov({"c": c.items, "b": b.items, "f": f.items})
    cov: Cov = {}
    for role, sc in (("c", c), ("b", b), ("f", f)):
        se = own_stderr(sc)
        if se is None:
            return None
        cov[role, role] = se * se
    return cov


def own_stderr(sc: Score) -> float | None:
    """A score's standard error: the results' own, else the spread of its items; None: neither."""
    if sc.stderr is None and sc.items and len(sc.items) >= 2:
        return math.sqrt(_item_cov({"x": sc.items})["x", "x"])
    return sc.stderr


def _mean_stderr(terms: Sequence[tuple[dict[str, float], Cov | None]]) -> float | None:
    """se of the mean of per-benchmark values, from each value's partials and the covariance of
    the scores it uses (benchmarks are independent of each other)."""
    if not terms:
        return None
    var = 0.0
    for partial, cov in terms:
        used = [r for r, d in partial.items() if d != 0.0]
        if not used:
            continue
        if cov is None:
            return None
        var += sum(partial[r1] * partial[r2] * cov.get((r1, r2), 0.0) for r1 in used for r2 in used)
    return math.sqrt(max(var, 0.0)) / len(terms)


def hm_partials(repair: float | None, retention: float | None) -> tuple[float, float]:
    """(∂HM/∂R, ∂HM/∂T) at (R, T), for the HM of :func:`metrics.harmonic_mean` (a missing one: 0)."""
    if repair is None:
        return 0.0, 1.0
    if retention is None:
        return 1.0, 0.0
    if repair > 0 and retention > 0:
        s = (repair + retention) ** 2
        return 2.0 * retention**2 / s, 2.0 * repair**2 / s
    return (1.0, 0.0) if repair < retention else (0.0, 1.0)  # a tie of the min: see uncertainty


def uncertainty(
    c: Mapping[str, Score],
    benchmarks: Sequence[dict],
    repair: float | None,
    retention: float | None,
    *,
    base: Mapping[str, Score] | None = None,
    ft: Mapping[str, Score] | None = None,
    targets_in_retention: bool = False,
    unchanged_in_repair: bool = False,
) -> dict[str, float | int | None]:
    """``repair_stderr``, ``retention_stderr`` and ``hm_stderr`` of one candidate (None where
    undefined or where a score they use has no standard error), and ``stderr_paired_benchmarks``:
    how many benchmarks were compared item by item (``base``/``ft``: their Scores, with items)."""
    rep: list[tuple[dict[str, float], Cov | None]] = []
    ret: list[tuple[dict[str, float], Cov | None]] = []
    paired = 0
    for bm in benchmarks:
        part, k = bm["partition"], bm["name"]
        b, f, cv = bm["base"], bm["ft"], c[k].value
        sb = base[k] if base is not None and k in base else Score(b, bm["base_stderr"])
        sf = ft[k] if ft is not None and k in ft else Score(f, bm["ft_stderr"])
        cov = score_cov(c[k], sb, sf)
        if part == "damaged":
            rep.append((_partials(part, cv, b, f, False), cov))
        elif part == "improved" or (part == "target" and targets_in_retention and f != b):
            ret.append((_partials(part, cv, b, f, False), cov))
        elif part == "unchanged" and unchanged_in_repair and b > 0:
            rep.append((_partials(part, cv, b, f, True), cov))
        else:
            continue
        paired += cov is not None and ("c", "f") in cov
    se_r = _mean_stderr(rep) if repair is not None else None
    se_t = _mean_stderr(ret) if retention is not None else None
    unknown = (repair is not None and se_r is None) or (retention is not None and se_t is None)
    if (repair is None and retention is None) or unknown:
        se_hm = None
    else:
        d_r, d_t = hm_partials(repair, retention)
        tie_of_min = repair is not None and repair == retention and not repair > 0
        if tie_of_min:  # HM = min(R, T) with R = T: the larger of the two ses
            se_hm = max(se_r or 0.0, se_t or 0.0)
        else:
            se_hm = math.sqrt((d_r * (se_r or 0.0)) ** 2 + (d_t * (se_t or 0.0)) ** 2)
    return {
        "repair_stderr": se_r,
        "retention_stderr": se_t,
        "hm_stderr": se_hm,
        "stderr_paired_benchmarks": paired,
    }


# -- differences between two candidates (the sweep's comparisons with its incumbent)

Gradient = dict[str, dict[str, float]]


def measure_gradient(
    measure: str,
    c: Mapping[str, Score],
    benchmarks: Sequence[dict],
    repair: float | None,
    retention: float | None,
    *,
    targets_in_retention: bool = False,
    unchanged_in_repair: bool = False,
) -> Gradient:
    """∂(measure)/∂(candidate, base, fine-tune score) per benchmark name, for ``measure`` "hm",
    "retention" or "normalised_accuracy" (the fields of :func:`metrics.score_one`), at the
    candidate's scores: the same means the metrics take, differentiated term by term."""
    rep: list[tuple[str, dict[str, float]]] = []
    ret: list[tuple[str, dict[str, float]]] = []
    norm: list[tuple[str, dict[str, float]]] = []
    for bm in benchmarks:
        part, k = bm["partition"], bm["name"]
        b, f, cv = bm["base"], bm["ft"], c[k].value
        if part == "damaged":
            rep.append((k, _partials(part, cv, b, f, False)))
        elif part == "improved" or (part == "target" and targets_in_retention and f != b):
            ret.append((k, _partials(part, cv, b, f, False)))
        elif part == "unchanged" and unchanged_in_repair and b > 0:
            rep.append((k, _partials(part, cv, b, f, True)))
        if part in ("improved", "target") and bm.get("unit") != "unbounded" and f > 0:
            norm.append((k, {"c": 100.0 / f, "f": -100.0 * cv / f**2}))
    if measure == "normalised_accuracy":
        weights = [(norm, 1.0)]
    elif measure == "retention":
        weights = [(ret, 1.0)]
    else:
        d_r, d_t = hm_partials(repair, retention)
        weights = [(rep, d_r), (ret, d_t)]
    out: Gradient = {}
    for terms, w in weights:
        for k, partial in terms:
            g = out.setdefault(k, {})
            for role, d in partial.items():
                g[role] = g.get(role, 0.0) + w * d / len(terms)
    return out


def _joint_cov(scores: Mapping[str, Score], used: Sequence[str]) -> Cov | None:
    """The covariance of several models' scores on one benchmark: item by item among the models
    that list the same number of items (the same items: two candidates are paired even where
    BASE's and FT's results give stderrs only), the others independent (each its stderr, or the
    spread of its own items); None where one the difference uses has neither."""
    # the models that list the same number of items answered the same items: their joint
    # covariance from the items; any other is independent of them (its stderr alone)
    counts: dict[int, list[str]] = {}
    for role, sc in scores.items():
        if sc.items and len(sc.items) >= 2:
            counts.setdefault(len(sc.items), []).append(role)
    group = max(counts.values(), key=len, default=[])
    cov: Cov = {}
    if len(group) >= 2 and any(r in group for r in used):
        cov.update(_item_cov({r: scores[r].items for r in group}))  # type: ignore[misc]
    for role in used:
        if role in group and len(group) >= 2:
            continue
        se = own_stderr(scores[role])
        if se is None:
            return None
        cov[role, role] = se * se
    return cov


def difference_stderr(
    g1: Gradient,
    g2: Gradient,
    c1: Mapping[str, Score],
    c2: Mapping[str, Score],
    base: Mapping[str, Score],
    ft: Mapping[str, Score],
) -> tuple[float | None, bool]:
    """The standard error of ``measure(c1) − measure(c2)`` (the two candidates' gradients from
    :func:`measure_gradient`), and whether every benchmark it uses was compared item by item.

    Both candidates are scored against the same base and fine-tune, so their terms in the
    difference partly cancel; with per-item results the four models' covariance on the same
    items is used (paired: two candidates that get the same items right differ by little),
    otherwise the four are taken as independent. None: a score it uses has no standard error."""
    var, paired = 0.0, True
    for k in dict.fromkeys([*g1, *g2]):
        p1, p2 = g1.get(k, {}), g2.get(k, {})
        grad = {
            "c1": p1.get("c", 0.0),
            "c2": -p2.get("c", 0.0),
            "b": p1.get("b", 0.0) - p2.get("b", 0.0),
            "f": p1.get("f", 0.0) - p2.get("f", 0.0),
        }
        used = [r for r, d in grad.items() if d != 0.0]
        if not used:
            continue
        roles = {"c1": c1[k], "c2": c2[k], "b": base[k], "f": ft[k]}
        cov = _joint_cov(roles, used)
        if cov is None:
            return None, False
        paired = paired and ("c1", "c2") in cov
        var += sum(grad[r1] * grad[r2] * cov.get((r1, r2), 0.0) for r1 in used for r2 in used)
    return math.sqrt(max(var, 0.0)), paired
