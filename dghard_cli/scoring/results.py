"""Reading evaluation results: lm-evaluation-harness output or a plain ``{"benchmark": score}``
JSON, put on one scale, **points** (0–100; unbounded scores such as a −NLL stay in their own
units, see :mod:`dghard_cli.scoring.scales`), with the metric chosen per task."""

from __future__ import annotations

import fnmatch
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Union

from dghard_cli.errors import InputError
from dghard_cli.io.checkpoint import path_exists, read_json_file
from dghard_cli.io.files import RESULTS_LIMIT, realpath, walk_files
from dghard_cli.scoring import scales

#: Metric names that represent a task, most preferred first.
METRIC_PRIORITY = ("acc_norm", "acc", "exact_match", "pass@1", "pass_at_1", "mc2", "f1", "em")


#: Filters preferred when a metric comes under several.
FILTER_PRIORITY = ("none", "strict-match")


#: Keys of an lm-evaluation-harness task entry that are not metrics.
NON_METRIC_KEYS = {"alias", "samples", "sample_len", "sample_count", "name", "task"}


SCALES = ("auto", "fraction", "points")


#: The largest score or standard error magnitude read (in the file's own units). No benchmark
#: comes near it (accuracies are ≤ 100, a −NLL or perplexity ≤ 10^6); a value past it is a broken
#: or hostile file, and kept it would overflow the scoring's own arithmetic (differences,
#: ratios, harmonic means, sqrt(se_b² + se_f²)) into inf/NaN. 10^12 leaves every product and
#: square of two such values (≤ 10^24 · the ×100 of fractions) far inside float64's range.
MAX_SCORE = 1e12


class Score(NamedTuple):
    """One benchmark's score and standard error, in points (stderr None when unknown), and its
    per-item values where the results give them (``items``, in points, in the evaluation's item
    order: scores of several models on the same items are then compared item by item)."""

    value: float
    stderr: float | None = None
    items: tuple[float, ...] | None = None


#: Items one benchmark may list (far beyond any benchmark: MMLU has 14 042).
MAX_ITEMS = 10_000_000


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
    #: per-item values, in the unit of the file's score (see Score.items)
    items: dict[str, tuple[float, ...]] = field(default_factory=dict)

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


def check_score(source: str, bench: str, value: float, stderr: float | None, what: str = "score") -> None:
    """The one bound on what a results file may hold (:data:`MAX_SCORE`): InputError naming the
    file, the benchmark and the value otherwise. Every reader of scores passes through here."""
    for label, v in ((what, value), ("standard error", stderr)):
        if v is None:
            continue
        if not math.isfinite(v):
            raise InputError(
                f"{source}: benchmark {bench!r}: the {label} is {v} (not a finite number); fix the file"
            )
        if abs(v) > MAX_SCORE:
            raise InputError(
                f"{source}: benchmark {bench!r}: the {label} {v:.6g} is beyond what any benchmark "
                f"reports (|x| > {MAX_SCORE:.0e}); fix the file or the evaluation that wrote it"
            )


def _stderr_value(v: object) -> float | None:
    if _is_number(v) and math.isfinite(float(v)) and float(v) >= 0:  # type: ignore[arg-type]
        return float(v)  # type: ignore[arg-type]
    return None  # "N/A", null, NaN


def find_results_file(directory: Path) -> Path:
    """The lm-evaluation-harness results file under a directory (its newest ``results*.json``).

    The directory is walked without following symlinked directories; a symlinked file is
    found here and refused when it is read if it resolves outside the directory.
    """
    found = sorted(
        p for p in walk_files(directory) if fnmatch.fnmatch(p.name, "results*.json") and os.path.isfile(p)
    )
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
    """The benchmarks of an lm-eval file, in file order: each top-level task, a group without a
    score replaced by its subtasks (``subtasks``: every group by its leaves).

    The group graph is walked once, depth first, with one visited set: a group shared by
    several parents (or a cycle) is expanded the first time it is reached, so a graph that fans
    out exponentially, or 10^5 tasks, costs time linear in its size and no recursion.
    """
    results = doc["results"]
    tree = doc.get("group_subtasks")
    tree = tree if isinstance(tree, dict) else {}
    children = {c for subs in tree.values() if isinstance(subs, list) for c in subs if isinstance(c, str)}

    def has_score(t: str) -> bool:
        e = results.get(t)
        return isinstance(e, dict) and bool(_metric_entries(e))

    out: dict[str, None] = {}  # an ordered set
    visited: set[str] = set()
    for top in (t for t in results if t not in children):
        stack = [top]
        while stack:
            t = stack.pop()
            if t in visited:
                continue
            visited.add(t)
            subs = (
                [s for s in tree.get(t) or [] if isinstance(s, str)] if isinstance(tree.get(t), list) else []
            )
            if not subs or (not subtasks and has_score(t)):
                if subtasks and t not in results:
                    continue
                out.setdefault(t, None)
                continue
            stack.extend(reversed(subs))
    return list(out)


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
    roots: Sequence[Path] | None = None,
) -> ResultFile:
    """Read one results file (or an lm-evaluation-harness output directory) on the points scale.

    ``fixed`` maps task -> metric key and forces those keys (used so that every file is read
    with the metrics chosen for the base).
    """
    p = Path(path).expanduser()
    if not os.path.lexists(p) and not path_exists(p):
        raise InputError(f"{label} {path}: no such file or directory")
    if p.is_dir():
        roots = (realpath(p),)  # files found in a directory must lie inside it
        p = find_results_file(p)
    doc = read_json_file(p, f"{label} file", limit=RESULTS_LIMIT, roots=roots)
    source = str(p)
    rule = metric if isinstance(metric, MetricRule) else MetricRule.parse(metric)
    if isinstance(doc, dict) and isinstance(doc.get("results"), dict):
        rf = _read_lm_eval(doc, source, rule, dict(fixed or {}), scale, subtasks)
        rf.items = lm_eval_items(p, rf, roots)
        rf.scores = with_items(rf.scores, rf.items, rf.units, rf.scale)
        return rf
    if isinstance(doc, dict):
        return _read_plain(doc, source, scale)
    raise InputError(
        f"{source}: not an lm-evaluation-harness results file (no 'results' object) nor a "
        "{benchmark: score} JSON object"
    )


#: Bytes one lm-eval samples file may have (it holds every document, prompt and response).
SAMPLES_LIMIT = 256 * 1024 * 1024


def _sample_rows(samples: Path, name: str, filt: str | None, roots: Sequence[Path]) -> list[float] | str:
    """A samples file's values of metric ``name`` (filter ``filt``) in doc_id order, or why it
    cannot pair (a string): streamed line by line (lines end at ``\n`` only: lm-eval writes
    prompts unescaped, U+2028 included), at most MAX_ITEMS records."""
    import json

    from dghard_cli.io.files import open_input

    rows: list[tuple[int, float]] = []
    try:
        with open_input(samples, what="lm-eval samples file", roots=roots, limit=SAMPLES_LIMIT) as f:
            buf, n = b"", 0
            while True:
                chunk = f.read(1 << 20)
                buf += chunk
                *lines, buf = buf.split(b"\n") if chunk else (*buf.split(b"\n"), b"")
                for line in lines:
                    n += 1
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except (ValueError, RecursionError):
                        return f"line {n} is not JSON"
                    if not isinstance(rec, dict) or (filt is not None and rec.get("filter") != filt):
                        continue
                    v, doc_id = rec.get(name), rec.get("doc_id")
                    v = float(v) if isinstance(v, bool) else v
                    if not (_is_number(v) and math.isfinite(float(v)) and isinstance(doc_id, int)):
                        return f"line {n}: {name!r} is not one number per item"
                    rows.append((doc_id, float(v)))
                    if len(rows) > MAX_ITEMS:
                        return f"more than {MAX_ITEMS} items"
                if not chunk:
                    break
    except InputError as exc:
        return str(exc)
    rows.sort()
    if [i for i, _ in rows] != list(range(len(rows))):
        return "its doc_ids are not 0, 1, …, n−1 (a subset of the documents cannot be paired by position)"
    return [v for _, v in rows]


def lm_eval_items(path: Path, rf: ResultFile, roots: Sequence[Path] | None) -> dict[str, tuple[float, ...]]:
    """Each task's per-item values from the samples lm-eval logged beside ``path``
    (``--log_samples``: ``samples_<task>_<time>.jsonl`` next to ``results_<time>.json``), for the
    metric and filter the task is scored by, in ``doc_id`` order. They only pair the standard
    errors: a samples file that cannot (unreadable, not one number per item, a subset of the
    documents, items that do not average to the score) is a warning, never a refusal."""
    stamp = path.stem.removeprefix("results_")
    out: dict[str, tuple[float, ...]] = {}
    if stamp == path.stem:
        return out
    roots = roots or (Path(os.path.realpath(path.parent)),)  # a samples file links nowhere else
    for task, key in rf.metrics.items():
        name, filt = _split_key(key)
        samples = path.parent / f"samples_{task}_{stamp}.jsonl"
        if not os.path.lexists(samples):
            continue
        got = _sample_rows(samples, name, filt, roots)
        if isinstance(got, str):
            rf.warnings.append(f"{samples}: {got}; the standard errors of {task!r} are not paired")
            continue
        if len(got) < 2:
            continue
        try:
            out[task] = _read_items(str(samples), task, rf.raw[task][0], got)
        except InputError as exc:
            rf.warnings.append(f"{exc}; the standard errors of {task!r} are not paired")
    return out


def load_results(path: str | Path, **kwargs) -> dict[str, Score]:
    """``{benchmark: Score(points, stderr points or None)}`` of one results file.

    Public in-memory API (the commands use :func:`read_results`).
    """
    return read_results(path, **kwargs).scores


def _read_items(source: str, name: str, value: float, items: object) -> tuple[float, ...]:
    """A benchmark's per-item values, in the unit of its score: their mean must be the score,
    or the score / 100 (0/1 correctness beside a score in points). InputError otherwise."""
    where = f"{source}: benchmark {name!r}: items"
    if not isinstance(items, list) or len(items) < 2:
        raise InputError(f"{where} must be a list of at least 2 per-item values (0/1 or scores)")
    if len(items) > MAX_ITEMS:
        raise InputError(f"{where}: {len(items)} values, more than {MAX_ITEMS} (is this a benchmark?)")
    if not all(_is_number(x) and math.isfinite(float(x)) and abs(float(x)) <= MAX_SCORE for x in items):
        raise InputError(f"{where} must all be finite numbers")
    xs = tuple(float(x) for x in items)
    mean = math.fsum(xs) / len(xs)
    tol = 1e-6 * max(1.0, abs(value))
    if abs(mean - value) <= tol:
        return xs
    if abs(100.0 * mean - value) <= tol:
        return tuple(100.0 * x for x in xs)
    raise InputError(
        f"{where} average {mean:.6g}, not the score {value:.6g} (nor its hundredth): give the "
        "values the score is the mean of, in the evaluation's item order"
    )


def _read_plain(doc: dict, source: str, scale: str) -> ResultFile:
    raw: dict[str, tuple[float, float | None]] = {}
    items: dict[str, tuple[float, ...]] = {}
    for name, val in doc.items():
        if _is_number(val):
            v, se = float(val), None
        elif isinstance(val, dict) and _is_number(val.get("score")):
            v, se = float(val["score"]), _stderr_value(val.get("stderr"))
        else:
            raise InputError(
                f"{source}: benchmark {name!r} is {type(val).__name__}, not a number; expected "
                '{"benchmark": score} (or {"benchmark": {"score": x, "stderr": y, "items": [...]}})'
            )
        check_score(source, str(name), v, se)
        raw[str(name)] = (v, se)
        if isinstance(val, dict) and val.get("items") is not None:
            items[str(name)] = _read_items(source, str(name), v, val["items"])
    if not raw:
        raise InputError(f"{source}: no benchmark scores in this file")
    used, scores, units = _apply_scale(raw, scale, source)
    scores = with_items(scores, items, units, used)
    return ResultFile(
        source=source, format="plain", scale=used, scores=scores, units=units, raw=raw, items=items
    )


def with_items(
    scores: dict[str, Score], items: Mapping[str, tuple[float, ...]], units: Mapping[str, str], scale: str
) -> dict[str, Score]:
    """``scores`` with each benchmark's items in points: multiplied by what its score was (100
    for a fraction)."""
    if not items:
        return scores
    out = dict(scores)
    for k, xs in items.items():
        f = 100.0 if (units.get(k) == scales.FRACTION or (not units and scale == "fraction")) else 1.0
        out[k] = out[k]._replace(items=tuple(f * x for x in xs))
    return out


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
        se = _stderr_value(entry.get(_stderr_key(key)))
        check_score(source, task, v, se, what=f"score ({key})")
        raw[task] = (v, se)
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
