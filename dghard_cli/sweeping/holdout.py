"""The held-out estimate of the winner: ``{split}`` in ``--eval``.

A sweep chooses on its evaluation, so the winner's score there is optimistic: it is the best of
many noisy measurements (and the tie rule of :mod:`.choose` only narrows that). When the
template has a ``{split}`` placeholder the sweep evaluates BASE, FT and every candidate with
``{split}`` = ``val``, chooses its winner, and only then evaluates BASE, FT and the winner once
with ``{split}`` = ``test``. The report's ``holdout`` gives the winner's held-out HM ± stderr
and the *optimism*, validation HM minus held-out HM. The ``test`` results are read after the
choice is final, so they never influence it; they are cached like every evaluation (a resumed
sweep does not run them again). The command decides what the splits are (two disjoint item
ranges, two task lists: ``--limit`` and ``--samples`` for lm-eval, two files for a script).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

from dghard_cli._version import __version__
from dghard_cli.errors import InputError
from dghard_cli.scoring.experts import expert_reference
from dghard_cli.scoring.metrics import score_candidates
from dghard_cli.scoring.results import ResultFile, read_results
from dghard_cli.sweeping import integrity
from dghard_cli.sweeping.cache import digest, input_identity
from dghard_cli.sweeping.command import CHOOSE_SPLIT, HELD_OUT_SPLIT, for_split, uses_split
from dghard_cli.sweeping.jobs import Job, JobResult
from dghard_cli.sweeping.state import SweepState
from dghard_cli.sweeping.steps import as_adapter, eval_job, run_jobs, spec_for_job, write_candidate_dir


def evaluate_winner(s: SweepState, winner: dict, wdir: Path) -> dict:
    """Evaluate BASE, the fine-tune(s) and the winner (in ``wdir``) on the held-out split and
    score the winner against them there; the report's ``holdout``. A held-out evaluation that
    fails is reported (``status``), never fatal: the winner is chosen already."""
    from dghard_cli.lora.source import is_adapter

    template = for_split(s.opts.eval_template, HELD_OUT_SPLIT)
    snap = integrity.snapshot(wdir)
    items: list[tuple[str, str, Job]] = []
    before: dict[str, object] = {}
    for label, ck in [("base", s.base_ck), *((f"ft{i + 1}", ck) for i, ck in enumerate(s.ft_cks))]:
        key = digest(
            {
                "held-out": label,
                "input": input_identity(ck),
                "template": s.opts.eval_template,
                "dghard": __version__,
            }
        )
        model = spec_for_job(s, ck.source) if is_adapter(ck) else str(ck.path.resolve())  # as references()
        before[label] = input_identity(ck)
        items.append((label, key, eval_job(s, key, f"{label.upper()} ({HELD_OUT_SPLIT})", template=template,
                                           model=model, model_is_adapter=is_adapter(ck))))  # fmt: skip
    wkey = digest({"held-out": "winner", "candidate": winner["key"], "template": s.opts.eval_template})
    adapter = as_adapter(s, s.cands[winner["key"]])
    items.append(("winner", wkey, eval_job(s, wkey, f"{winner['name']} ({HELD_OUT_SPLIT})", template=template,
                                           model=str(wdir.resolve()), model_is_adapter=adapter)))  # fmt: skip
    recs: dict[str, dict] = {}
    todo = []
    for label, key, job in items:
        rec = s.cache.get(key)
        if rec is not None:
            recs[label] = rec
        else:
            todo.append(job)
    labels = {key: label for label, key, _ in items}
    s.emit(
        kind="info",
        message=f"held-out split: evaluating {len(todo)} of BASE, FT and the winner on {HELD_OUT_SPLIT!r}",
    )

    def done(job: Job, res: JobResult) -> None:
        rec = res.rec
        if res.cacheable or rec["status"] == "ok":
            rec = s.cache.put(job.key, rec, Path(res.results) if res.results else None)
        recs[labels[job.key]] = rec
        shutil.rmtree(s.job_dir(job.key), ignore_errors=True)

    run_jobs(s, todo, done)
    out: dict = {"split": HELD_OUT_SPLIT, "chosen_on": CHOOSE_SPLIT, "evaluations_run": len(todo),
                 "from_cache": len(items) - len(todo)}  # fmt: skip
    s.holdout_runs = len(todo)
    changed = integrity.changed(wdir, snap)
    if changed:  # the winner is written again (OUT gets what its command writes); no estimate
        write_candidate_dir(s, s.cands[winner["key"]], winner["key"], wdir)
        out.update(
            status="failed",
            message=f"the evaluation changed the winner it evaluated ({changed}), which was written again; "
            "evaluate {model} without writing into it",
        )
        return out
    inputs = [
        (lb, ck) for lb, ck in [("base", s.base_ck), *((f"ft{i + 1}", c) for i, c in enumerate(s.ft_cks))]
    ]
    moved = next((lb for lb, ck in inputs if input_identity(ck) != before[lb]), None)
    if moved is not None:
        out.update(status="failed", message=f"the evaluation modified {moved.upper()} while evaluating it")
        return out
    failed = [(lb, r) for lb, r in recs.items() if r["status"] != "ok"]
    if failed or len(recs) != len(items):
        lb, r = failed[0] if failed else ("?", {"message": "not evaluated"})
        out.update(status="failed", message=f"the held-out evaluation of {lb} failed: {r.get('message')}")
        return out
    try:
        rfs = {
            lb: read_results(
                s.cache.results_path(r), metric=s.rule, fixed=s.base_rf.metrics, scale=s.opts.units,
                label=f"held-out results of {lb}",
            )
            for lb, r in recs.items()
        }  # fmt: skip
        return {**out, **_score(s, rfs, winner)}
    except InputError as exc:
        out.update(status="failed", message=f"unreadable held-out results: {exc}")
        return out


def _score(s: SweepState, rfs: dict[str, ResultFile], winner: dict) -> dict:
    fts = [rfs[f"ft{i + 1}"] for i in range(len(s.ft_cks))]
    ft = (
        fts[0]
        if len(fts) == 1
        else expert_reference(rfs["base"], fts, targets=s.opts.targets, margin=s.opts.margin)[0]
    )
    doc = score_candidates(
        rfs["base"],
        ft,
        [("winner", rfs["winner"])],
        targets=s.opts.targets,
        margin=s.opts.margin,
        targets_in_retention=len(fts) > 1,
        unchanged_in_repair=len(fts) > 1,
        units_option="--units",
    )
    cd = doc["candidates"][0]
    keys = (
        "hm",
        "hm_stderr",
        "repair",
        "repair_stderr",
        "retention",
        "retention_stderr",
        "normalised_accuracy",
    )
    held = {k: cd[k] for k in keys}
    val = {k: winner[k] for k in ("hm", "hm_stderr", "repair", "retention", "normalised_accuracy")}
    optimism = optimism_se = None
    if held["hm"] is not None and val["hm"] is not None:
        optimism = val["hm"] - held["hm"]
        ses = (val["hm_stderr"], held["hm_stderr"])
        optimism_se = None if None in ses else math.hypot(*ses)  # the two splits' items are disjoint
    return {
        "status": "ok",
        "winner": held,
        "validation": val,
        "optimism": optimism,
        "optimism_stderr": optimism_se,
        "counts": doc["counts"],
        "warnings": doc["warnings"],
    }


__all__ = ["CHOOSE_SPLIT", "HELD_OUT_SPLIT", "evaluate_winner", "for_split", "uses_split"]
