"""Partition-conditioned scoring of evaluation results (``dghard score``).

Inputs are lm-evaluation-harness result files (or the directories it writes them into) or a
plain ``{"benchmark": score}`` JSON. Every score is put on one scale, **points** (0–100):

- units (:mod:`dghard_cli.score.scales`): under ``auto`` each benchmark of each file is a
  fraction (in [0, 1]: ×100), points, or unbounded (below 0 or above 100, a −NLL: kept in its
  own units, margin floor relative to its size), made consistent across files. ``scale=``
  forces ``fraction`` or ``points`` for every benchmark of a file.

Which metric represents an lm-evaluation-harness task (keys ``name,filter`` such as
``acc,none`` with ``name_stderr,filter`` siblings):

- ``--metric NAME`` (every task that has it; an error if none has) or ``--metric TASK=NAME``
  (that task, which must have it); ``NAME`` is a metric (``acc``: its ``none`` filter first)
  or a full key (``exact_match,flexible-extract``);
- otherwise (and for tasks without the global ``--metric``) the first present of ``acc_norm, acc, exact_match, pass@1, pass_at_1, mc2, f1, em``,
  filter ``none`` first, then ``strict-match``, then the file's order; failing those, the task's
  first higher-is-better numeric metric. Metrics the file marks lower-is-better are never
  chosen. The base file decides each task's metric; the other files must carry the same key.
- Benchmarks are the top level of the file's task tree (``group_subtasks``): a group with an
  aggregate score stands for its subtasks; a group without one is replaced by its subtasks.
  ``subtasks=True`` scores the leaf tasks instead.

The definitions (per benchmark, from base ``b``, fine-tune ``f``, candidate ``c``, in points):

- margin ``m``: ``margin=`` if given, else ``max(0.5, 2·se)`` with ``se = sqrt(se_b² + se_f²)``
  (``√2·se`` of the one file that carries it; no stderr: 0.5);
- *damaged* if ``f < b − m``, *improved* if ``f > b + m``, else *unchanged*; ``targets`` are
  set apart and scored on their own;
- % repair = mean over damaged of ``(c − f)/(b − f)·100`` (100: back to base, 0: no better than
  the fine-tune, negative: worse); % retention = mean over improved of ``(c − b)/(f − b)·100``;
- HM = ``2·R·T/(R + T)`` when both are positive; the smaller of the two when either is ≤ 0
  (continuous at 0, and a candidate that undoes more than it keeps ranks low); the defined one
  when the other is undefined (no damaged, or no improved, benchmarks); undefined when both are;
- unchanged: the mean of ``c − b`` in points; target retention = ``(c − b)/(f − b)·100`` per
  target (undefined when ``f = b``) and their mean.

Candidates are ranked by HM (undefined last), then % repair, then % retention. The gate
(``fail_under``) looks at the best-ranked candidate and fails when its HM is below the bar or
undefined.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Union

from dghard_cli import __version__
from dghard_cli.errors import InputError
from dghard_cli.io.checkpoint import path_exists, read_json_file
from dghard_cli.score import scales

SCHEMA_VERSION = 1
DEFAULT_MIN_MARGIN = 0.5
DEFAULT_STDERR_FACTOR = 2.0

#: Metric names that represent a task, most preferred first.
METRIC_PRIORITY = ("acc_norm", "acc", "exact_match", "pass@1", "pass_at_1", "mc2", "f1", "em")
#: Filters preferred when a metric comes under several.
FILTER_PRIORITY = ("none", "strict-match")
#: Keys of an lm-evaluation-harness task entry that are not metrics.
NON_METRIC_KEYS = {"alias", "samples", "sample_len", "sample_count", "name", "task"}
SCALES = ("auto", "fraction", "points")
PARTITIONS = ("damaged", "improved", "unchanged", "target")


class Score(NamedTuple):
    """One benchmark's score and standard error, in points (stderr None when unknown)."""

    value: float
    stderr: float | None = None


ScoreLike = Union[Score, float, int, tuple]


@dataclass
class ResultFile:
    """A results file, read and put on the points scale."""

    source: str
    format: str  # "lm-eval" | "plain"
    scale: str  # "fraction" | "points"
    scores: dict[str, Score]
    metrics: dict[str, str] = field(default_factory=dict)  # task -> key used (lm-eval)
    warnings: list[str] = field(default_factory=list)
    #: --units auto: each benchmark's unit (score.scales); empty when --units forced one
    units: dict[str, str] = field(default_factory=dict)
    raw: dict[str, tuple[float, float | None]] = field(default_factory=dict)  # as the file has them

    def describe(self) -> dict:
        d: dict = {"path": self.source, "format": self.format, "scale": self.scale}
        if self.scale == "mixed":
            d["units"] = dict(self.units)
        if self.metrics:
            d["metrics"] = dict(self.metrics)
        return d


@dataclass
class MetricRule:
    """``--metric`` options: one metric for every task and/or per-task choices."""

    default: str | None = None
    per_task: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, values: Iterable[str] | str | None) -> MetricRule:
        rule = cls()
        if values is None:
            return rule
        if isinstance(values, str):
            values = [values]
        for v in values:
            v = v.strip()
            if not v:
                raise InputError("--metric: empty value (use NAME, NAME,FILTER or TASK=NAME)")
            if "=" in v:
                task, name = (s.strip() for s in v.split("=", 1))
                if not task or not name:
                    raise InputError(f"--metric {v!r}: expected TASK=NAME")
                rule.per_task[task] = name
            else:
                if rule.default is not None and rule.default != v:
                    raise InputError(
                        f"--metric given twice for every task ({rule.default!r}, {v!r}); "
                        "use TASK=NAME for per-task choices"
                    )
                rule.default = v
        return rule


# -- reading files ---------------------------------------------------------------------------


def _split_key(key: str) -> tuple[str, str | None]:
    if "," in key:
        name, filt = key.split(",", 1)
        return name, filt
    return key, None


def _stderr_key(key: str) -> str:
    name, filt = _split_key(key)
    return f"{name}_stderr" + (f",{filt}" if filt is not None else "")


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _metric_entries(entry: Mapping) -> list[tuple[int, str, str, str | None]]:
    """Numeric metric keys of a task entry: (file position, key, name, filter)."""
    out = []
    for i, (key, val) in enumerate(entry.items()):
        if key in NON_METRIC_KEYS or not _is_number(val):
            continue
        name, filt = _split_key(key)
        if name.endswith("_stderr"):
            continue
        out.append((i, key, name, filt))
    return out


def _filter_rank(filt: str | None) -> int:
    if filt is None:
        return 0
    return FILTER_PRIORITY.index(filt) if filt in FILTER_PRIORITY else len(FILTER_PRIORITY)


def choose_metric(
    task: str, entry: Mapping, higher_is_better: Mapping | None, requested: str | None, source: str
) -> str | None:
    """The key that represents ``task`` (see the module docstring); None if it has no score."""
    entries = _metric_entries(entry)
    hib = higher_is_better or {}

    def lower_is_better(name: str) -> bool:
        return hib.get(name) is False

    if requested is not None:
        if "," in requested or any(k == requested for _, k, _, _ in entries):
            matches = [e for e in entries if e[1] == requested]
        else:
            matches = sorted(
                (e for e in entries if e[2] == requested), key=lambda e: (_filter_rank(e[3]), e[0])
            )
        if not matches:
            have = ", ".join(k for _, k, _, _ in entries) or "no numeric metric"
            raise InputError(
                f"{source}: task {task!r} has no metric {requested!r} (it has: {have}); "
                f"pass --metric {task}=NAME for this task"
            )
        key, name = matches[0][1], matches[0][2]
        if lower_is_better(name):
            raise InputError(
                f"{source}: metric {key!r} of task {task!r} is lower-is-better; "
                "scoring needs a higher-is-better metric (--metric)"
            )
        return key
    usable = [e for e in entries if not lower_is_better(e[2])]
    if not usable:
        return None
    n = len(METRIC_PRIORITY)

    def rank(e: tuple[int, str, str, str | None]) -> tuple[int, int, int]:
        name_rank = METRIC_PRIORITY.index(e[2]) if e[2] in METRIC_PRIORITY else n
        return (name_rank, _filter_rank(e[3]) if name_rank < n else 0, e[0])

    return min(usable, key=rank)[1]


def _matches(key: str, requested: str) -> bool:
    return key == requested or ("," not in requested and _split_key(key)[0] == requested)


def _requested(rule: MetricRule, task: str, entry: Mapping) -> str | None:
    """The metric asked for this task: its own (strict), or the global one where it has it."""
    if task in rule.per_task:
        return rule.per_task[task]
    if rule.default is not None and any(_matches(k, rule.default) for _, k, _, _ in _metric_entries(entry)):
        return rule.default
    return None


def _stderr_value(v: object) -> float | None:
    if _is_number(v) and math.isfinite(float(v)) and float(v) >= 0:  # type: ignore[arg-type]
        return float(v)  # type: ignore[arg-type]
    return None  # "N/A", null, NaN


def find_results_file(directory: Path) -> Path:
    """The lm-evaluation-harness results file under a directory (its newest ``results*.json``)."""
    found = sorted(p for p in directory.rglob("results*.json") if p.is_file())
    if not found:
        raise InputError(
            f"{directory}: no results*.json file in this directory (pass an lm-evaluation-harness "
            "results file or a {benchmark: score} JSON)"
        )
    parents = {p.parent for p in found}
    if len(parents) > 1:
        raise InputError(
            f"{directory}: results files of {len(parents)} different runs "
            f"({', '.join(sorted(str(p) for p in parents)[:3])}); pass one results file"
        )
    return max(found, key=lambda p: p.name)  # lm-eval names them results_<timestamp>.json


def _tasks_to_score(doc: Mapping, subtasks: bool) -> list[str]:
    results = doc["results"]
    tree = doc.get("group_subtasks")
    tree = tree if isinstance(tree, dict) else {}
    children = {c for subs in tree.values() if isinstance(subs, list) for c in subs}

    def has_score(t: str) -> bool:
        e = results.get(t)
        return isinstance(e, dict) and bool(_metric_entries(e))

    def leaves(t: str, seen: frozenset = frozenset()) -> list[str]:
        subs = [s for s in tree.get(t) or [] if isinstance(s, str)]
        if not subs or t in seen:
            return [t] if t in results else []
        out = []
        for s in subs:
            out += leaves(s, seen | {t})
        return out

    def expand(t: str, seen: frozenset = frozenset()) -> list[str]:
        subs = [s for s in tree.get(t) or [] if isinstance(s, str)]
        if has_score(t) or not subs or t in seen:
            return [t]
        out = []
        for s in subs:
            out += expand(s, seen | {t})
        return out

    top = [t for t in results if t not in children]
    out: list[str] = []
    for t in top:
        for x in leaves(t) if subtasks else expand(t):
            if x not in out:
                out.append(x)
    return out


def _apply_scale(
    raw: dict[str, tuple[float, float | None]], scale: str, source: str
) -> tuple[str, dict, dict[str, str]]:
    """(the file's unit, its scores in points, each benchmark's unit under auto)."""
    if scale not in SCALES:
        raise InputError(f"--units {scale!r} is not one of {', '.join(SCALES)}")
    if scale == "auto":
        units = scales.auto_units(raw)
        pts = scales.to_points(raw, units)
        return scales.file_unit(units), {t: Score(v, s) for t, (v, s) in pts.items()}, units
    if scale == "fraction":
        bad = [(t, v) for t, (v, _) in raw.items() if not 0.0 <= v <= 1.0]
        if bad:
            raise InputError(f"{source}: --units fraction but {bad[0][0]!r} is {bad[0][1]:g}, not in [0, 1]")
        return scale, {t: Score(100.0 * v, None if s is None else 100.0 * s) for t, (v, s) in raw.items()}, {}
    return scale, {t: Score(v, s) for t, (v, s) in raw.items()}, {}


def read_results(
    path: str | Path,
    *,
    metric: MetricRule | Iterable[str] | str | None = None,
    fixed: Mapping[str, str] | None = None,
    scale: str = "auto",
    subtasks: bool = False,
    label: str = "results",
) -> ResultFile:
    """Read one results file (or an lm-evaluation-harness output directory) on the points scale.

    ``fixed`` maps task -> metric key and forces those keys (used so that every file is read
    with the metrics chosen for the base).
    """
    p = Path(path).expanduser()
    if not path_exists(p):
        raise InputError(f"{label} {path}: no such file or directory")
    if p.is_dir():
        p = find_results_file(p)
    doc = read_json_file(p, f"{label} file")
    source = str(p)
    rule = metric if isinstance(metric, MetricRule) else MetricRule.parse(metric)
    if isinstance(doc, dict) and isinstance(doc.get("results"), dict):
        return _read_lm_eval(doc, source, rule, dict(fixed or {}), scale, subtasks)
    if isinstance(doc, dict):
        return _read_plain(doc, source, scale)
    raise InputError(
        f"{source}: not an lm-evaluation-harness results file (no 'results' object) nor a "
        "{benchmark: score} JSON object"
    )


def load_results(path: str | Path, **kwargs) -> dict[str, Score]:
    """``{benchmark: Score(points, stderr points or None)}`` of one results file.

    Public in-memory API (the commands use :func:`read_results`).
    """
    return read_results(path, **kwargs).scores


def _read_plain(doc: dict, source: str, scale: str) -> ResultFile:
    raw: dict[str, tuple[float, float | None]] = {}
    for name, val in doc.items():
        if _is_number(val):
            v, se = float(val), None
        elif isinstance(val, dict) and _is_number(val.get("score")):
            v, se = float(val["score"]), _stderr_value(val.get("stderr"))
        else:
            raise InputError(
                f"{source}: benchmark {name!r} is {type(val).__name__}, not a number; expected "
                '{"benchmark": score} (or {"benchmark": {"score": x, "stderr": y}})'
            )
        if not math.isfinite(v):
            raise InputError(f"{source}: benchmark {name!r} has a non-finite score")
        raw[str(name)] = (v, se)
    if not raw:
        raise InputError(f"{source}: no benchmark scores in this file")
    used, scores, units = _apply_scale(raw, scale, source)
    return ResultFile(source=source, format="plain", scale=used, scores=scores, units=units, raw=raw)


def _read_lm_eval(
    doc: dict, source: str, rule: MetricRule, fixed: dict[str, str], scale: str, subtasks: bool
) -> ResultFile:
    results = doc["results"]
    hib_all = doc.get("higher_is_better") if isinstance(doc.get("higher_is_better"), dict) else {}
    tasks = _tasks_to_score(doc, subtasks)
    raw: dict[str, tuple[float, float | None]] = {}
    metrics: dict[str, str] = {}
    warnings: list[str] = []
    for task in tasks:
        entry = results.get(task)
        if not isinstance(entry, dict):
            continue
        hib = hib_all.get(task) if isinstance(hib_all.get(task), dict) else None
        if task in fixed:
            key = fixed[task]
            if not _is_number(entry.get(key)):
                have = ", ".join(k for _, k, _, _ in _metric_entries(entry)) or "no numeric metric"
                raise InputError(
                    f"{source}: task {task!r} has no metric {key!r}, which the base results use "
                    f"(it has: {have}); evaluate every model with the same tasks and metrics"
                )
        elif fixed:  # a task the base lacks: read leniently, it is reported as ignored
            try:
                key = choose_metric(task, entry, hib, _requested(rule, task, entry), source)
            except InputError:
                key = None
            if key is None:
                continue
        else:
            key = choose_metric(task, entry, hib, _requested(rule, task, entry), source)
            if key is None:
                warnings.append(f"{source}: task {task!r} has no higher-is-better score; skipped")
                continue
        v = float(entry[key])
        if not math.isfinite(v):
            raise InputError(f"{source}: task {task!r} metric {key!r} is {v} (not a finite score)")
        raw[task] = (v, _stderr_value(entry.get(_stderr_key(key))))
        metrics[task] = key
    if not raw:
        raise InputError(f"{source}: no task with a usable score in 'results'")
    if not fixed:
        unknown = [t for t in rule.per_task if t not in raw]
        if unknown:
            raise InputError(
                f"{source}: --metric {unknown[0]}=...: no scored task {unknown[0]!r} in this file "
                f"(tasks: {', '.join(raw)})"
            )
        if rule.default is not None and not any(
            _matches(k, rule.default) for t, k in metrics.items() if t not in rule.per_task
        ):
            raise InputError(f"{source}: --metric {rule.default!r} matches no task in this file")
    used, scores, units = _apply_scale(raw, scale, source)
    return ResultFile(
        source=source,
        format="lm-eval",
        scale=used,
        scores=scores,
        metrics=metrics,
        warnings=warnings,
        units=units,
        raw=raw,
    )


# -- scoring -----------------------------------------------------------------------------------


def as_score(v: ScoreLike, where: str) -> Score:
    if isinstance(v, Score):
        s = v
    elif isinstance(v, tuple):
        s = Score(float(v[0]), None if len(v) < 2 or v[1] is None else float(v[1]))
    elif _is_number(v):
        s = Score(float(v), None)
    else:
        raise InputError(f"{where}: {v!r} is not a score")
    if not math.isfinite(s.value):
        raise InputError(f"{where}: score {s.value} is not finite")
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
) -> dict:
    """Score candidates against base and fine-tune; returns the score document.

    All scores are in points. Raises InputError (exit 2) for a benchmark missing from the
    fine-tune or a candidate, an unknown target, a negative margin or no candidate.
    """
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
        if k in target_list:
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
    counts = {p: sum(1 for x in benchmarks if x["partition"] == p) for p in PARTITIONS}
    if counts["damaged"] == 0 and counts["improved"] == 0:
        warnings.append(
            "no damaged and no improved benchmarks (outside the targets, the fine-tune moved none by "
            "more than its margin): "
            "% repair, % retention and HM are undefined"
        )
    elif counts["damaged"] == 0:
        warnings.append("no damaged benchmarks: % repair is undefined and HM is the % retention alone")
    elif counts["improved"] == 0:
        warnings.append("no improved benchmarks: % retention is undefined and HM is the % repair alone")

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
        rows = []
        rep, ret, unch, tgt = [], [], [], {}
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
            else:
                val = (cv - bv) / (fv - bv) * 100.0 if fv != bv else None
                tgt[k] = val
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
        cands.append(
            {
                "name": name,
                "source": lab,
                "repair": repair,
                "retention": retention,
                "hm": harmonic_mean(repair, retention),
                "unchanged_mean_change": _mean(unch),
                "target_retention": tgt,
                "target_retention_mean": _mean(defined_t),
                "benchmarks": rows,
            }
        )

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

    order = [cd["name"] for _, cd in sorted(enumerate(cands), key=rank_key)]
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
    others = [("ft", ft), *((f"candidate {n}", r) for n, r in cand_list)]
    doc["units_assumed"] = scales.describe(base, others, min_margin)
    warnings += scales.notes(base, others)
    if fail_under is not None:
        doc["gate"] = gate(doc, fail_under)
    return doc


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


# -- files to document -------------------------------------------------------------------------

_NAME_SPEC = re.compile(r"^([^=/\\]+)=(.+)$")


def parse_candidate(spec: str) -> tuple[str | None, str]:
    """``NAME=PATH`` or ``PATH`` (a path that exists is never split at '=')."""
    if path_exists(Path(spec).expanduser()):
        return None, spec
    m = _NAME_SPEC.match(spec)
    if m:
        return m.group(1).strip(), m.group(2)
    return None, spec


def default_name(path: str) -> str:
    p = Path(path)
    stem = p.stem if p.suffix.lower() == ".json" else p.name
    if stem.startswith("results") and p.parent.name:
        stem = p.parent.name
    return stem or str(path)


def score_files(
    base: str | Path,
    ft: str | Path,
    candidates: Sequence[str],
    *,
    targets: Iterable[str] = (),
    margin: float | None = None,
    metric: Iterable[str] | str | None = None,
    scale: str = "auto",
    subtasks: bool = False,
    fail_under: float | None = None,
) -> dict:
    """Read the files and score: what ``dghard score`` does (the document it prints)."""
    rule = MetricRule.parse(metric)
    b = read_results(base, metric=rule, scale=scale, subtasks=subtasks, label="--base")
    fixed = b.metrics
    f = read_results(ft, metric=rule, fixed=fixed, scale=scale, subtasks=subtasks, label="--ft")
    cands: list[tuple[str, ResultFile]] = []
    used: set[str] = set()
    for spec in candidates:
        name, path = parse_candidate(spec)
        rf = read_results(path, metric=rule, fixed=fixed, scale=scale, subtasks=subtasks, label="--candidate")
        if name is None:
            name = default_name(path)
            k, base_name = 2, name
            while name in used:
                name, k = f"{base_name}#{k}", k + 1
        used.add(name)
        cands.append((name, rf))
    doc = score_candidates(b, f, cands, targets=targets, margin=margin, fail_under=fail_under)
    files = [b, f, *(rf for _, rf in cands)]
    warnings = [w for rf in files for w in rf.warnings]
    doc["warnings"] = warnings + doc["warnings"]
    doc["inputs"] = {
        "base": b.describe(),
        "ft": f.describe(),
        "candidates": [{"name": n, **rf.describe()} for n, rf in cands],
        "scale": scale,
        "subtasks": subtasks,
        "metric": {"default": rule.default, "per_task": rule.per_task},
    }
    return doc


# -- terminal rendering ------------------------------------------------------------------------
