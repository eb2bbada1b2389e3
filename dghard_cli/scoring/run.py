"""Partition-conditioned scoring of evaluation results (``dghard score``).

Inputs are lm-evaluation-harness result files (or the directories it writes them into) or a
plain ``{"benchmark": score}`` JSON. Every score is put on one scale, **points** (0–100):

- units (:mod:`dghard_cli.scoring.scales`): under ``auto`` each benchmark of each file is a
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

Steps: :mod:`.results` reads and normalises the files, :mod:`.metrics` partitions and scores;
this module turns the command's arguments into both.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from dghard_cli.io.checkpoint import path_exists
from dghard_cli.scoring.metrics import score_candidates
from dghard_cli.scoring.results import MetricRule, ResultFile, read_results

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
