"""The unit of each benchmark's score, and the margin floor in that unit (``--units auto``).

A results file may mix units: accuracies as fractions in [0, 1] next to a −NLL (negative,
unbounded) or a BLEU in points. Reading the whole file in one unit turns the fractions into
"points" an order of magnitude too small, and the 0.5-point margin floor then calls real damage
*unchanged*. So under ``auto`` each benchmark of each file gets its own unit, from its value
(and standard error):

- **unbounded** — the value is below 0 or above 100 (−NLL, a log-likelihood, a perplexity, a
  count): kept in its own units (no ×100); its margin floor is ``min_margin`` % of the larger of
  ``|base|`` and ``|ft|`` (0.5 % by default, as 0.5 points is of a 100-point scale); it is left out
  of the unchanged benchmarks' mean change in points;
- **fraction** — the value (and its stderr) lie in [0, 1]: ×100 to points; floor ``min_margin``
  points;
- **points** — otherwise (above 1, up to 100): as is; floor ``min_margin`` points.

Then the files are reconciled, benchmark by benchmark: a benchmark that is unbounded in one file
is unbounded in all of them (a −NLL of −0.4 is not a fraction); a benchmark that is points in one
file is points, not a fraction, in every other file that also holds points (a score of 0.8
points next to 1.4 points elsewhere); a file whose scores all lie in [0, 1] stays a fraction file
(files written by different tools may use different units). A file read with ``--units fraction``
or ``--units points`` keeps that unit for every benchmark.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

FRACTION, POINTS, UNBOUNDED = "fraction", "points", "unbounded"
ORDER = (FRACTION, POINTS, UNBOUNDED)

#: Benchmark names that suggest a lower-is-better score (the metrics assume higher is better).
LOWER_IS_BETTER = re.compile(r"(perplexity|ppl|loss|(?<![a-z])nll|bits_per_byte|bpb|(?<![a-z])wer)", re.I)


def classify(value: float, stderr: float | None) -> str:
    """The unit of one score (see the module)."""
    if value < 0.0 or value > 100.0 or (stderr is not None and stderr > 100.0):
        return UNBOUNDED
    if 0.0 <= value <= 1.0 and (stderr is None or stderr <= 1.0):
        return FRACTION
    return POINTS


def file_unit(units: Mapping[str, str]) -> str:
    """One word for a file: its benchmarks' unit when they share one, else ``mixed``."""
    found = set(units.values())
    return found.pop() if len(found) == 1 else "mixed"


def to_points(raw: Mapping[str, tuple[float, float | None]], units: Mapping[str, str]) -> dict:
    """``{benchmark: (value, stderr)}`` with the fractions multiplied by 100."""
    out = {}
    for k, (v, se) in raw.items():
        f = 100.0 if units[k] == FRACTION else 1.0
        out[k] = (f * v, None if se is None else f * se)
    return out


def auto_units(raw: Mapping[str, tuple[float, float | None]]) -> dict[str, str]:
    """Each benchmark's unit in one file, before the files are reconciled."""
    return {k: classify(v, se) for k, (v, se) in raw.items()}


def _units(rf) -> Mapping[str, str]:
    """A file's per-benchmark units, read-only (not copied: it is asked once per benchmark, and a
    copy each time made scoring 10^5 tasks quadratic)."""
    return getattr(rf, "units", None) or {}


def reconcile(files: Sequence) -> list:
    """The files (``ResultFile``; other mappings pass unchanged) with units made consistent
    across files (see the module). Files read with a forced ``--units`` carry no per-benchmark
    units and are left as they are."""
    auto = [rf for rf in files if _units(rf)]
    unbounded = {k for rf in auto for k, u in rf.units.items() if u == UNBOUNDED}
    points = {k for rf in auto for k, u in rf.units.items() if u == POINTS}
    out = []
    for rf in files:
        units = _units(rf)
        if not units:
            out.append(rf)
            continue
        new = {k: UNBOUNDED if k in unbounded else u for k, u in units.items()}
        bounded = [u for u in new.values() if u != UNBOUNDED]
        if any(u == POINTS for u in bounded):  # not a fraction file: a points benchmark stays points
            new = {k: POINTS if u == FRACTION and k in points else u for k, u in new.items()}
        if new == units:
            out.append(rf)
            continue
        pts = to_points(rf.raw, new)
        scores = {
            k: sc._replace(
                value=pts[k][0],
                stderr=pts[k][1],
                items=None
                if getattr(rf, "items", {}).get(k) is None
                else tuple((100.0 if new[k] == FRACTION else 1.0) * x for x in rf.items[k]),
            )
            for k, sc in rf.scores.items()
        }
        out.append(dataclasses.replace(rf, units=new, scale=file_unit(new), scores=scores))
    return out


def unit_of(rf, name: str) -> str:
    """A benchmark's unit in a file (a forced ``--units`` file: its unit; a mapping: points)."""
    units = _units(rf)
    if name in units:
        return units[name]
    return getattr(rf, "scale", POINTS) if getattr(rf, "scale", None) in ORDER else POINTS


def _value(results, name: str) -> float:
    v = results.scores[name] if hasattr(results, "scores") else results[name]
    return float(v[0] if isinstance(v, tuple) else v)


def margin_floor(unit: str, base: float, ft: float, min_margin: float) -> float:
    """The smallest margin of a benchmark, in the units its scores are compared in."""
    if unit == UNBOUNDED:
        return min_margin / 100.0 * max(abs(base), abs(ft))
    return min_margin


_ASSUMED = {
    FRACTION: "values in [0, 1]: fractions, ×100 to points; margin floor {m:g} points",
    POINTS: "values in (1, 100]: points; margin floor {m:g} points",
    UNBOUNDED: (
        "values below 0 or above 100 (a −NLL, a perplexity, a count): kept in their own units, "
        "not in the unchanged mean; margin floor {m:g} % of the larger of |base| and |ft|"
    ),
}


def describe(base, files: Sequence[tuple[str, object]], min_margin: float) -> list[dict]:
    """What was assumed, one entry per unit: the base's benchmarks in it, and the files that
    read one of them in another unit. ``files``: ``(label, results)`` of the other inputs."""
    groups: dict[str, list[str]] = {}
    names = list(base.scores) if hasattr(base, "scores") else list(base)
    for k in names:
        groups.setdefault(unit_of(base, k), []).append(k)
    out = []
    for unit in ORDER:
        if unit not in groups:
            continue
        entry: dict = {
            "unit": unit,
            "benchmarks": groups[unit],
            "assumed": _ASSUMED[unit].format(m=min_margin),
        }
        other = {}
        for label, rf in files:
            differ = [k for k in groups[unit] if k in getattr(rf, "scores", rf) and unit_of(rf, k) != unit]
            if differ:
                other[label] = {k: unit_of(rf, k) for k in differ}
        if other:
            entry["other_files"] = other
        out.append(entry)
    return out


#: what a command that cannot force a unit (``dghard sweep``) says instead of "pass --units"
NO_UNITS_OPTION = "check them with `dghard score --units` and have the evaluation write one unit"


def notes(base, files: Sequence[tuple[str, object]], *, units_option: str | None = "--units") -> list[str]:
    """Warnings about units: benchmarks read in different units in different files, names
    that look lower-is-better, and fractions in files that also hold points.

    ``units_option`` is the option that forces a unit, named in the advice; ``None`` for a
    command without one (the sweep reads every file under ``auto``)."""
    guess = (
        f"pass {units_option} if a guess is wrong"
        if units_option
        else f"if a guess is wrong, {NO_UNITS_OPTION}"
    )
    points = (
        f"pass {units_option} points if they are points"
        if units_option
        else f"if they are points, {NO_UNITS_OPTION}"
    )
    out = []
    names = list(base.scores) if hasattr(base, "scores") else list(base)
    differ = []
    for k in names:
        units = {unit_of(base, k)} | {unit_of(rf, k) for _, rf in files if k in getattr(rf, "scores", rf)}
        if len(units) > 1:
            differ.append(k)
    if differ:
        where = "; ".join(
            f"{k}: " + ", ".join(f"{label} {unit_of(rf, k)}" for label, rf in [("base", base), *files])
            for k in differ[:3]
        )
        out.append(
            f"benchmarks read in different units in different files ({where}"
            f"{'; …' if len(differ) > 3 else ''}); {guess}"
        )
    for label, rf in [("base", base), *files]:
        units = _units(rf)
        fr = [k for k, u in units.items() if u == FRACTION]
        if fr and any(u == POINTS for u in units.values()):
            out.append(
                f"{label} ({getattr(rf, 'source', label)}) mixes scores in [0, 1] with points: "
                f"{', '.join(fr[:4])}{' …' if len(fr) > 4 else ''} read as fractions (×100); "
                f"{points}"
            )
            break
    suspicious = [k for k in names if LOWER_IS_BETTER.search(k) and _value(base, k) > 0]
    if suspicious:
        out.append(
            f"{', '.join(suspicious[:4])}: the name looks like a lower-is-better score (loss, perplexity); "
            "dghard scores assume higher is better, so give its negative (−NLL) instead"
        )
    return out
