"""The partition-conditioned metrics of ``dghard score``: each benchmark is damaged, improved
or unchanged by the fine-tune (beyond a margin); a candidate is scored by % repair on the
damaged ones, % retention on the improved ones and their harmonic mean (HM).

Beside them, the merging literature's **normalised accuracy**: the mean, over the improved
benchmarks and the targets, of the candidate's score as a % of the fine-tune's (with several
fine-tunes, of each benchmark's expert's). It ignores what the base could do, so a sweep that
maximises it (``dghard sweep --objective normalised-accuracy``) chooses on the new skills alone.
A benchmark in unbounded units, or whose fine-tune score is not above 0, has no such ratio and
is left out of that mean."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from dghard_cli._version import __version__
from dghard_cli.errors import InputError
from dghard_cli.scoring import scales
from dghard_cli.scoring.results import MAX_SCORE, ResultFile, Score, ScoreLike, _is_number
from dghard_cli.scoring.uncertainty import difference_stderr, measure_gradient, uncertainty

SCHEMA_VERSION = 1


DEFAULT_MIN_MARGIN = 0.5


DEFAULT_STDERR_FACTOR = 2.0


PARTITIONS = ("damaged", "improved", "unchanged", "target")


def as_score(v: ScoreLike, where: str) -> Score:
    if isinstance(v, Score):
        s = v
    elif isinstance(v, tuple):
        s = Score(float(v[0]), None if len(v) < 2 or v[1] is None else float(v[1]))
    elif _is_number(v):
        s = Score(float(v), None)
    else:
        raise InputError(f"{where}: {v!r} is not a score")
    for label, x in (("score", s.value), ("standard error", s.stderr)):
        if x is not None and not (math.isfinite(x) and abs(x) <= MAX_SCORE):
            raise InputError(
                f"{where}: {label} {x:.6g} is not finite or beyond what any benchmark reports "
                f"(|x| > {MAX_SCORE:.0e})"
            )
    return s


def _scores(x: ResultFile | Mapping[str, ScoreLike], label: str) -> dict[str, Score]:
    if isinstance(x, ResultFile):
        return dict(x.scores)
    return {str(k): as_score(v, f"{label} benchmark {k!r}") for k, v in x.items()}


def _label(x: object, fallback: str) -> str:
    return x.source if isinstance(x, ResultFile) else fallback


def combined_stderr(se_base: float | None, se_ft: float | None) -> float | None:
    """Standard error of ``ft − base``: sqrt(se_b² + se_f²); √2·se when only one is known."""
    if se_base is not None and se_ft is not None:
        return math.hypot(se_base, se_ft)
    one = se_base if se_base is not None else se_ft
    return None if one is None else math.sqrt(2.0) * one


def harmonic_mean(repair: float | None, retention: float | None) -> float | None:
    """HM of % repair and % retention, with the edge cases of the module docstring."""
    if repair is None and retention is None:
        return None
    if repair is None:
        return retention
    if retention is None:
        return repair
    if repair > 0 and retention > 0:
        return 2.0 * repair * retention / (repair + retention)
    return min(repair, retention)


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


@dataclass(frozen=True)
class Rules:
    """How the partitions enter % repair and % retention. Both off: ``dghard score`` and a sweep
    of one fine-tune. Both on: a sweep of several fine-tunes (:mod:`dghard_cli.scoring.experts`).

    ``targets_in_retention``: % retention is the mean over the improved benchmarks *and* the
    targets, so HM weighs every expert's gain on its own benchmark; a missing damaged partition
    is then a note, not a warning. ``unchanged_in_repair``: an unchanged benchmark (a skill of the
    base no fine-tune moved beyond its margin) enters % repair as the share of the base's level
    the candidate keeps, c/b·100 (b > 0), so a merge that loses what every expert kept is
    penalised as one that fails to repair what an expert damaged."""

    targets_in_retention: bool = False
    unchanged_in_repair: bool = False


def score_candidates(
    base: ResultFile | Mapping[str, ScoreLike],
    ft: ResultFile | Mapping[str, ScoreLike],
    candidates: Mapping[str, ResultFile | Mapping[str, ScoreLike]]
    | Sequence[tuple[str, ResultFile | Mapping[str, ScoreLike]]],
    *,
    targets: Iterable[str] = (),
    margin: float | None = None,
    min_margin: float = DEFAULT_MIN_MARGIN,
    stderr_factor: float = DEFAULT_STDERR_FACTOR,
    fail_under: float | None = None,
    targets_in_retention: bool = False,
    unchanged_in_repair: bool = False,
    units_option: str | None = "--units",
) -> dict:
    """Score candidates against base and fine-tune; returns the score document.

    ``units_option`` is the option the unit warnings advise (``None``: the caller has none).
    ``targets_in_retention`` and ``unchanged_in_repair``: see :class:`Rules`.

    All scores are in points. The steps: the inputs checked and put on one scale, each
    benchmark's margin and partition (:func:`partition`), what the partitions leave undefined
    (:func:`coverage`), each candidate scored (:func:`score_one`) and ranked (:func:`ranking`).
    Raises InputError (exit 2) for a benchmark missing from the fine-tune or a candidate, an
    unknown target, a negative margin or no candidate.
    """
    rules = Rules(targets_in_retention, unchanged_in_repair)
    if margin is not None and not (math.isfinite(margin) and margin >= 0):
        raise InputError(f"--margin must be a finite number >= 0, got {margin}")
    if fail_under is not None and not math.isfinite(fail_under):
        raise InputError(f"--fail-under must be finite, got {fail_under}")
    cand_list = list(candidates.items()) if isinstance(candidates, Mapping) else list(candidates)
    if not cand_list:
        raise InputError("no candidate results given (--candidate R)")
    names = [n for n, _ in cand_list]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise InputError(f"candidate name {dup!r} given twice; name them with --candidate NAME=PATH")
    base, ft, *others = scales.reconcile([base, ft, *(r for _, r in cand_list)])
    cand_list = [(n, r) for (n, _), r in zip(cand_list, others, strict=True)]
    b = _scores(base, "base")
    f = _scores(ft, "ft")
    base_label, ft_label = _label(base, "base"), _label(ft, "ft")
    target_list = list(dict.fromkeys(targets))
    warnings: list[str] = []
    for t in target_list:
        if t not in b:
            raise InputError(
                f"--target {t!r}: no such benchmark in the base results {base_label} "
                f"(benchmarks: {', '.join(b) or 'none'})"
            )
    missing = [k for k in b if k not in f]
    if missing:
        raise InputError(
            f"fine-tune results {ft_label} lack benchmark {missing[0]!r}"
            f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}, present in the base "
            f"results {base_label}; evaluate both on the same benchmarks"
        )
    extra = [k for k in f if k not in b]
    if extra:
        warnings.append(f"benchmarks only in the fine-tune's results ignored: {', '.join(extra)}")
    benchmarks = partition(base, b, f, target_list, margin, min_margin, stderr_factor, warnings)
    counts = {p: sum(1 for x in benchmarks if x["partition"] == p) for p in PARTITIONS}
    notes = coverage(counts, benchmarks, rules, warnings)
    cands = []
    for name, res in cand_list:
        c = _scores(res, f"candidate {name}")
        lab = _label(res, name)
        miss = [k for k in b if k not in c]
        if miss:
            raise InputError(
                f"candidate {name!r} ({lab}) lacks benchmark {miss[0]!r}"
                f"{f' (and {len(miss) - 1} more)' if len(miss) > 1 else ''}; every candidate must be "
                "evaluated on the base's benchmarks"
            )
        extra_c = [k for k in c if k not in b]
        if extra_c:
            warnings.append(f"candidate {name!r}: benchmarks not in the base ignored: {', '.join(extra_c)}")
        cands.append(score_one(name, lab, c, benchmarks, rules, base=b, ft=f))
    order = ranking(cands)
    for cd in cands:
        cd["rank"] = order.index(cd["name"]) + 1
    doc: dict = {
        "schema_version": SCHEMA_VERSION,
        "kind": "score",
        "tool": {"name": "dghard", "version": __version__},
        "units": "points",
        "margin": {
            "fixed": margin,
            "min_margin": min_margin,
            "stderr_factor": stderr_factor,
        },
        "targets": target_list,
        "counts": counts,
        "benchmarks": benchmarks,
        "candidates": cands,
        "ranking": order,
        "best": order[0],
        "warnings": warnings,
    }
    if rules.targets_in_retention:
        doc["retention_includes_targets"] = True
        doc["notes"] = notes
    if rules.unchanged_in_repair:
        doc["unchanged_in_repair"] = True
    others = [("ft", ft), *((f"candidate {n}", r) for n, r in cand_list)]
    doc["units_assumed"] = scales.describe(base, others, min_margin)
    warnings += scales.notes(base, others, units_option=units_option)
    if fail_under is not None:
        doc["gate"] = gate(doc, fail_under)
    return doc


def partition(
    base: ResultFile | Mapping[str, ScoreLike],
    b: dict[str, Score],
    f: dict[str, Score],
    targets: list[str],
    margin: float | None,
    min_margin: float,
    stderr_factor: float,
    warnings: list[str],
) -> list[dict]:
    """Each benchmark's margin and partition (damaged, improved, unchanged, or a target), in the
    base's order; a target the fine-tune moved by less than its margin adds a warning."""
    benchmarks: list[dict] = []
    for k, sb in b.items():
        sf = f[k]
        se = combined_stderr(sb.stderr, sf.stderr)
        unit = scales.unit_of(base, k)
        floor = scales.margin_floor(unit, sb.value, sf.value, min_margin)
        if margin is not None:
            m, rule = margin, "fixed"
        elif se is not None:
            m, rule = max(floor, stderr_factor * se), "stderr"
        else:
            m, rule = floor, "floor"
        change = sf.value - sb.value
        if k in targets:
            part = "target"
            if abs(change) <= m:
                warnings.append(
                    f"target {k!r}: the fine-tune moved it by {change:+.2f} points, within the "
                    f"margin {m:.2f}; its retention is noise"
                )
        elif change < -m:
            part = "damaged"
        elif change > m:
            part = "improved"
        else:
            part = "unchanged"
        benchmarks.append(
            {
                "name": k,
                "base": sb.value,
                "ft": sf.value,
                "base_stderr": sb.stderr,
                "ft_stderr": sf.stderr,
                "combined_stderr": se,
                "margin": m,
                "margin_rule": rule,
                "ft_change": change,
                "partition": part,
                "unit": unit,
            }
        )
    return benchmarks


def coverage(counts: dict[str, int], benchmarks: list[dict], rules: Rules, warnings: list[str]) -> list[str]:
    """What the partitions leave undefined: a warning each (into ``warnings``), or, under
    ``rules.targets_in_retention``, a note (returned) where that is expected."""
    notes: list[str] = []
    gains = counts["improved"] + (counts["target"] if rules.targets_in_retention else 0)
    kept = (
        [x for x in benchmarks if x["partition"] == "unchanged" and x["base"] > 0]
        if rules.unchanged_in_repair
        else []
    )
    if rules.targets_in_retention and counts["damaged"] == 0 and gains and kept:
        notes.append(
            "no benchmark outside the targets was damaged by any fine-tune: % repair is the share of the "
            f"base's level kept on the {len(kept)} unchanged one(s)"
        )
    elif rules.targets_in_retention and counts["damaged"] == 0 and gains:
        notes.append(
            "no benchmark outside the targets was damaged by any fine-tune: % repair is undefined and "
            "HM is the % retention (targets and improved benchmarks) alone"
        )
    elif counts["damaged"] == 0 and gains == 0:
        warnings.append(
            "no damaged and no improved benchmarks (outside the targets, the fine-tune moved none by "
            "more than its margin): "
            "% repair, % retention and HM are undefined"
        )
    elif counts["damaged"] == 0:
        warnings.append("no damaged benchmarks: % repair is undefined and HM is the % retention alone")
    elif gains == 0:
        warnings.append("no improved benchmarks: % retention is undefined and HM is the % repair alone")
    return notes


def score_one(
    name: str,
    source: str,
    c: dict[str, Score],
    benchmarks: list[dict],
    rules: Rules,
    *,
    base: dict[str, Score] | None = None,
    ft: dict[str, Score] | None = None,
) -> dict:
    """One candidate's scores: per benchmark (by its partition), % repair, % retention, HM, and
    their standard errors (item by item where ``base``, ``ft`` and ``c`` list the items)."""
    rows = []
    rep, ret, unch, tgt, norm = [], [], [], {}, []
    for bm in benchmarks:
        k = bm["name"]
        cv = c[k].value
        bv, fv = bm["base"], bm["ft"]
        part = bm["partition"]
        if part == "damaged":
            val = (cv - fv) / (bv - fv) * 100.0
            rep.append(val)
        elif part == "improved":
            val = (cv - bv) / (fv - bv) * 100.0
            ret.append(val)
        elif part == "unchanged":
            val = cv - bv
            if bm["unit"] != scales.UNBOUNDED:  # the mean is in points
                unch.append(val)
            if rules.unchanged_in_repair and bv > 0:  # the share of the base's level kept
                val = cv / bv * 100.0
                rep.append(val)
        else:
            val = (cv - bv) / (fv - bv) * 100.0 if fv != bv else None
            tgt[k] = val
            if rules.targets_in_retention and val is not None:
                ret.append(val)
        if part in ("improved", "target") and bm["unit"] != scales.UNBOUNDED and fv > 0:
            norm.append(cv / fv * 100.0)
        rows.append(
            {
                "name": k,
                "partition": part,
                "value": cv,
                "stderr": c[k].stderr,
                "vs_base": cv - bv,
                "vs_ft": cv - fv,
                "score": val,
            }
        )
    repair, retention = _mean(rep), _mean(ret)
    defined_t = [v for v in tgt.values() if v is not None]
    se = uncertainty(
        c,
        benchmarks,
        repair,
        retention,
        base=base,
        ft=ft,
        targets_in_retention=rules.targets_in_retention,
        unchanged_in_repair=rules.unchanged_in_repair,
    )
    return {
        "name": name,
        "source": source,
        "repair": repair,
        "retention": retention,
        "hm": harmonic_mean(repair, retention),
        **se,
        "normalised_accuracy": _mean(norm),
        "unchanged_mean_change": _mean(unch),
        "target_retention": tgt,
        "target_retention_mean": _mean(defined_t),
        "benchmarks": rows,
    }


#: The measures a difference can be taken of (fields of a candidate's scores).
MEASURES = ("hm", "retention", "normalised_accuracy")


def differences(
    base: ResultFile | Mapping[str, ScoreLike],
    ft: ResultFile | Mapping[str, ScoreLike],
    candidates: Sequence[tuple[str, ResultFile | Mapping[str, ScoreLike]]],
    doc: dict,
    against: str,
    measure: str = "hm",
) -> dict[str, dict]:
    """Each candidate's ``measure`` minus candidate ``against``'s, with the standard error of
    that difference: ``{name: {"diff", "diff_stderr", "paired"}}``.

    ``doc`` is what :func:`score_candidates` returned for the same ``base``, ``ft`` and
    ``candidates`` (its partitions and rules). The two candidates share base and fine-tune, and
    on per-item results their items too, so the difference is far surer than their two
    stderrs suggest (:func:`uncertainty.difference_stderr`); ``paired``: compared item by item
    on every benchmark it uses. A difference whose stderr is unknown has ``diff_stderr`` None."""
    if measure not in MEASURES:
        raise ValueError(f"measure must be one of {MEASURES}, got {measure!r}")
    base_r, ft_r, *others = scales.reconcile([base, ft, *(r for _, r in candidates)])
    b, f = _scores(base_r, "base"), _scores(ft_r, "ft")
    scores = {n: _scores(r, f"candidate {n}") for (n, _), r in zip(candidates, others, strict=True)}
    rules = Rules(bool(doc.get("retention_includes_targets")), bool(doc.get("unchanged_in_repair")))
    by_name = {cd["name"]: cd for cd in doc["candidates"]}

    def gradient(name: str) -> dict:
        cd = by_name[name]
        return measure_gradient(
            measure,
            scores[name],
            doc["benchmarks"],
            cd["repair"],
            cd["retention"],
            targets_in_retention=rules.targets_in_retention,
            unchanged_in_repair=rules.unchanged_in_repair,
        )

    ref = by_name[against]
    g_ref = gradient(against) if ref[measure] is not None else {}
    out: dict[str, dict] = {}
    for name in scores:
        v, v0 = by_name[name][measure], ref[measure]
        if v is None or v0 is None:
            out[name] = {"diff": None, "diff_stderr": None, "paired": False}
        elif name == against:
            out[name] = {"diff": 0.0, "diff_stderr": 0.0, "paired": True}
        else:
            se, paired = difference_stderr(gradient(name), g_ref, scores[name], scores[against], b, f)
            out[name] = {"diff": v - v0, "diff_stderr": se, "paired": paired and se is not None}
    return out


def ranking(cands: list[dict]) -> list[str]:
    """The candidates' names, best first: by HM, then % repair, then % retention (undefined
    last), then the order given."""

    def rank_key(i_c: tuple[int, dict]) -> tuple:
        i, cd = i_c
        neg = -math.inf
        return (
            cd["hm"] is None,
            -(cd["hm"] if cd["hm"] is not None else neg),
            -(cd["repair"] if cd["repair"] is not None else neg),
            -(cd["retention"] if cd["retention"] is not None else neg),
            i,
        )

    return [cd["name"] for _, cd in sorted(enumerate(cands), key=rank_key)]


def gate(doc: dict, fail_under: float) -> dict:
    """The ``--fail-under`` decision on the best-ranked candidate."""
    best = next(c for c in doc["candidates"] if c["name"] == doc["ranking"][0])
    hm = best["hm"]
    if hm is None:
        passed = False
        reason = (
            f"candidate {best['name']!r}: HM is undefined (no damaged and no improved benchmarks), "
            f"so the gate at {fail_under:g} cannot pass"
        )
    elif hm < fail_under:
        passed = False
        reason = f"candidate {best['name']!r}: HM {hm:.2f} is below --fail-under {fail_under:g}"
    else:
        passed = True
        reason = f"candidate {best['name']!r}: HM {hm:.2f} >= {fail_under:g}"
    return {"fail_under": fail_under, "candidate": best["name"], "hm": hm, "passed": passed, "reason": reason}
