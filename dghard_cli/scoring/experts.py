"""Scoring against several fine-tunes (experts) of one base: the reference "FT" score of each
benchmark, chosen per benchmark, in the spirit of the merging literature's normalised accuracy
(merged / the expert's own accuracy), measured on the gain over the base.

For each benchmark *k*, with base score *b* and the experts' scores *f_1 … f_n*:

- a **target**, or a benchmark some expert improved (the best expert *f_max > b + m*, the
  margin *m* computed as ``score`` does from *b* and that expert's stderr): the reference is
  the **best expert**'s score. Its retention (c − b)/(f_max − b) is the share of that expert's
  own gain the candidate keeps: 100 % is the expert's level on its own benchmark.
- any other benchmark (a skill of the base): the reference is the **worst expert**'s score.
  It is *damaged* when that expert fell below the base by more than its margin, and its
  % repair (c − f_min)/(b − f_min) says how much of the base's skill the candidate keeps
  (100 %: the base's level, 0 %: no better than the fine-tune that damaged it most); else it
  is unchanged, and (``unchanged_in_repair``, as the sweep scores) its % repair is the share of
  the base's level kept, c/b: a merge that loses a skill every expert kept is penalised.

The experts are not asked which benchmark is theirs: the best expert on a benchmark is the one
it belongs to. With these references, :func:`dghard_cli.scoring.metrics.score_candidates` scores
with ``targets_in_retention=True``: % retention is the mean over the improved benchmarks and
the targets, so HM = harmonic mean of (keeping every expert's gain, keeping the base's skills).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from dghard_cli.errors import InputError
from dghard_cli.scoring import scales
from dghard_cli.scoring.metrics import DEFAULT_MIN_MARGIN, DEFAULT_STDERR_FACTOR, score_candidates
from dghard_cli.scoring.results import ResultFile, Score, ScoreLike


def _scores(x: ResultFile | Mapping[str, ScoreLike]) -> dict[str, Score]:
    if isinstance(x, ResultFile):
        return dict(x.scores)
    return {str(k): v if isinstance(v, Score) else Score(float(v), None) for k, v in x.items()}  # type: ignore[arg-type]


def expert_reference(
    base: ResultFile | Mapping[str, ScoreLike],
    experts: Sequence[ResultFile | Mapping[str, ScoreLike]],
    *,
    targets: Iterable[str] = (),
    margin: float | None = None,
    min_margin: float = DEFAULT_MIN_MARGIN,
    stderr_factor: float = DEFAULT_STDERR_FACTOR,
) -> tuple[ResultFile | dict[str, Score], dict[str, dict]]:
    """The reference "FT" score of every benchmark of ``base`` and where it comes from.

    Returns ``(reference, chosen)``: ``reference[k]`` is one expert's Score (value and stderr;
    a ResultFile carrying each benchmark's unit and raw value when the experts are files, so
    units reconcile across files as ``score`` does),
    ``chosen[k] = {"expert": i, "rule": "best" | "worst"}`` (``i`` counts from 0 in the order
    given). Ties go to the expert given first. InputError when an expert lacks a benchmark.
    """
    if not experts:
        raise InputError("no fine-tune results given")
    b = _scores(base)
    fs = [_scores(e) for e in experts]
    for i, f in enumerate(fs):
        missing = [k for k in b if k not in f]
        if missing:
            raise InputError(
                f"fine-tune #{i + 1}'s results lack benchmark {missing[0]!r}, present in the base results"
            )
    best_i = {k: max(range(len(fs)), key=lambda i: (fs[i][k].value, -i)) for k in b}
    worst_i = {k: min(range(len(fs)), key=lambda i: (fs[i][k].value, i)) for k in b}
    best = {k: fs[best_i[k]][k] for k in b}
    probe = score_candidates(
        base,
        best,
        [("best expert", best)],
        targets=targets,
        margin=margin,
        min_margin=min_margin,
        stderr_factor=stderr_factor,
    )
    reference: dict[str, Score] = {}
    chosen: dict[str, dict] = {}
    for bm in probe["benchmarks"]:
        k = bm["name"]
        rule = "best" if bm["partition"] in ("target", "improved") else "worst"
        i = best_i[k] if rule == "best" else worst_i[k]
        reference[k] = fs[i][k]
        chosen[k] = {"expert": i, "rule": rule}
    if not all(isinstance(e, ResultFile) for e in experts):
        return reference, chosen
    files: list[ResultFile] = list(experts)  # type: ignore[arg-type]
    pick = {k: files[v["expert"]] for k, v in chosen.items()}
    units = {k: rf.units[k] for k, rf in pick.items() if k in rf.units}
    return (
        ResultFile(
            source="the fine-tunes (each benchmark's expert)",
            format=files[0].format,
            scale=scales.file_unit(units) if units else files[0].scale,
            scores=reference,
            metrics=dict(files[0].metrics),
            units=units,
            raw={k: rf.raw[k] for k, rf in pick.items() if k in rf.raw},
        ),
        chosen,
    )
