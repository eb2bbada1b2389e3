"""``dghard sweep``: find the repair (or merge) that works for this checkpoint, judged by the
user's own evaluation command, within a budget of evaluations.

1. **References**: BASE and FT (and every ``extra_fts`` fine-tune) are evaluated once, or
   read from ``base_results``/``ft_results``. Every evaluation that runs, or would run,
   counts against ``budget``; given results do not.
2. **Candidates** (:mod:`.sweep_candidates`) are chosen by :mod:`.sweep_search` (coarse grid,
   then golden-section refinement), each written by ``repair``/``merge`` into the staging
   directory, evaluated, scored with ``score``'s definitions against the references, and
   deleted unless it is the best so far.
3. **Choice**: the winner maximises HM among the candidates whose every target keeps at least
   ``min_target_retention`` % of the fine-tune's gain (when a bar is in force); candidates within
   ``tie_rule`` standard errors of their paired difference from the best (or ``tie_tolerance``
   points) tie with it, and the declared prior of :mod:`.choose` picks among them (the data-free
   default, else the middle of the widest family plateau by distance to the fine-tune: the
   ‖W_c − W_ref‖ / ‖W_ref − W_base‖ over all floating tensors, with W_ref = FT (several
   fine-tunes: W_base + Σ_i Δ_i), measured on the written checkpoint). ``tie_rule`` 0: the
   earlier rule, of the tied the closest to the fine-tune, then the earlier evaluated.
4. **Output**: OUT receives the winner's checkpoint (or adapter) exactly as the printed command writes it,
   plus ``sweep_report.json`` and, with matplotlib, ``sweep_frontier.png``. Nothing else
   stays on disk. An interrupted sweep keeps ``.OUT.dghard-sweep`` beside OUT: its cache
   (one entry per evaluation, keyed by the candidate's parameters, the inputs' file sizes and
   modification times and the evaluation template) lets the same command resume without
   evaluating anything twice.

With several fine-tunes each benchmark is scored against its own expert
(:mod:`dghard_cli.scoring.experts`: the best fine-tune on a target or on a benchmark one improved,
the worst on a skill of the base), the targets count in % retention, there is no target bar
unless one is given (:func:`effective_bar`), and the ``merges:`` block of the candidate file
(:mod:`.merges`) makes one strength entry per registered merge method, then follow-ups for the
best merge (its density, a LiNeS schedule).

The sweep's state is data (:mod:`.state`: ``SweepState``, ``CandidateRow``, ``SweepOptions``);
the steps are functions of it in their own modules: :mod:`.setup` (options checked, inputs
opened), :mod:`.steps` (references and candidates evaluated, scored), :mod:`.cache`,
:mod:`.choose` (the winner and the distance to the fine-tune), :mod:`.report`; this module
holds the search loop.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from dghard_cli.errors import CheckFailed, InputError, Interrupted, RuntimeFailure
from dghard_cli.io.atomic import swap_dir_into_place
from dghard_cli.io.lock import OutLock
from dghard_cli.sweeping import compare, holdout, integrity, merges, setup, steps
from dghard_cli.sweeping import report as sweep_report
from dghard_cli.sweeping.cache import Cache, dir_bytes, write_json
from dghard_cli.sweeping.candidates import Candidate, FamilyEntry
from dghard_cli.sweeping.choose import choose_winner
from dghard_cli.sweeping.execution import make_executor
from dghard_cli.sweeping.search import coarse_allotment, coarse_order, next_round
from dghard_cli.sweeping.state import STAGING_SUFFIX, SweepOptions, SweepState, staging_path

__all__ = ["SWEEP_REPORT", "STAGING_SUFFIX", "SweepOptions", "staging_path", "sweep"]

SWEEP_REPORT = "sweep_report.json"


# -- the loop


def round_in(s: SweepState, entries: list[FamilyEntry], budget: int) -> list[tuple[Candidate, str]]:
    """The next round among ``entries`` (coarse grid, then refinement, as if they had
    ``budget`` evaluations of their own), cut to what is left of ``budget``."""
    n = len(s.ft_cks)
    coarse = coarse_order(entries, n)
    allot = coarse_allotment(max(1, budget), len(coarse), len(entries))
    coarse_keys = {c.params for c in coarse}
    evaluated = {s.cands[r["key"]].params: r["objective"] for r in s.rows}
    done = sum(1 for r in s.rows if s.cands[r["key"]].params in coarse_keys)

    def rank(e: FamilyEntry) -> tuple | None:
        objs = [r["objective"] for r in s.rows if r["entry"] == e.index and r["objective"] is not None]
        return max(objs) if objs else None

    return next_round(entries, n, coarse, evaluated, done, allot, rank, compare.ties(s), s.noise_skipped)


def search(s: SweepState) -> None:
    """The entries' search, round by round; with ``merges:`` follow-ups (sweeping/merges.py),
    the strength search first (all but the follow-ups' reserve), then the follow-ups of the
    best merge, then whatever the strength search has left."""
    first = list(s.active)
    reserve = merges.followup_reserve(first, s.cand_budget)
    later: list[FamilyEntry] | None = None if reserve else []
    later_budget = 0
    while len(s.rows) < s.cand_budget:
        first_room = s.cand_budget - reserve - len(s.rows)
        if later is None and (first_room <= 0 or not round_in(s, first, s.cand_budget - reserve)):
            later = derive_followups(s)
            s.active += later
            later_budget = s.cand_budget - len(s.rows)
        batch: list[tuple[Candidate, str]] = []
        if later:
            batch = [
                (c, "follow-up" if phase == "coarse" else phase)  # a follow-up's own grid point
                for c, phase in round_in(s, later, later_budget)
            ]
        if not batch:
            batch = round_in(s, first, s.cand_budget - reserve)
            if later is None:
                batch = batch[: max(0, first_room)]
        if not batch:
            break
        steps.evaluate_round(s, batch[: s.cand_budget - len(s.rows)])


def derive_followups(s: SweepState) -> list[FamilyEntry]:
    """The follow-up entries of the ``merges:`` entries' best merges so far (none if none):
    the best one's, then those of every other family within noise of it
    (:func:`merges.followup_families`)."""
    by_index = {e.index: e for e in s.active}
    rows = [
        r
        for r in s.rows
        if r["objective"] is not None and by_index.get(r["entry"]) and by_index[r["entry"]].followups
    ]
    start = max((e.index for e in s.active), default=-1) + 1
    out: list[FamilyEntry] = []
    top = max(rows, key=lambda r: (r["objective"], -r["order"]), default=None)
    dens = merges.density_followup_size(by_index[top["entry"]]) if top is not None else 0
    near = merges.followup_families(rows, s.opts.tie_tolerance, s.cand_budget, dens)
    for k, best in enumerate(near):
        entries, notes = merges.followups(
            by_index[best["entry"]],
            s.cands[best["key"]],
            start + len(out),
            s.base_ck,
            s.ft_cks[0],
            density=k == 0,
        )
        s.warnings += [n for n in notes if n not in s.warnings]
        out += entries
    for e in out:
        s.emit(kind="info", message=f"{e.origin}")
    return out


# -- output


def finish(s: SweepState) -> dict:
    winner, reason = choose_winner(s.rows, s.bar, s.opts.tie_tolerance, s.opts.objective, s.opts.tie_rule)
    shutil.rmtree(s.stage / "jobs", ignore_errors=True)
    final = s.stage / "final"
    shutil.rmtree(final, ignore_errors=True)
    regenerated = False
    held: dict | None = None
    if winner is not None:
        wdir = s.stage / "winner"
        kept = steps.on_disk(s, wdir, winner["key"])
        problem = "it was not kept on disk" if kept is None else None
        if kept is not None:
            problem = integrity.verify_hashes(wdir, kept.get("snapshot"))
            problem = problem and f"it changed on disk: {problem}"
        if problem:
            # what stage/winner holds lost after all (several at a time, a tie tolerance or
            # the units of later results can reorder the winner): kept, or deleted
            if kept is None:
                steps.drop(s, wdir)
            else:  # the winner itself, changed by the evaluation: never kept
                shutil.rmtree(wdir, ignore_errors=True)
            if not steps.from_kept(s, winner["key"], wdir):
                s.emit(kind="info", message=f"writing the winner {winner['name']} again ({problem})")
                steps.write_candidate_dir(s, s.cands[winner["key"]], winner["key"], wdir)
                regenerated = True
        if holdout.uses_split(s.opts.eval_template):  # the choice is final: now the held-out split
            held = holdout.evaluate_winner(s, winner, wdir)
        os.replace(wdir, final)
        (s.stage / "winner.key").unlink(missing_ok=True)
    else:
        shutil.rmtree(s.stage / "winner", ignore_errors=True)
        (s.stage / "winner.key").unlink(missing_ok=True)
        final.mkdir()
    kept = s.stage / "kept"
    if s.opts.keep_candidates and kept.is_dir():
        for keyfile in kept.glob("*.key"):
            keyfile.unlink()
        os.replace(kept, final / "candidates")
    doc = sweep_report.report(s, winner, reason, regenerated)
    doc["holdout"] = held
    doc["budget"]["refinements_inside_noise"] = len(s.noise_skipped)
    left = s.cand_budget - len(s.rows)
    if s.noise_skipped and left > 0:
        doc.setdefault("notes", []).append(
            f"{left} candidate evaluation(s) of --budget left unspent; {len(s.noise_skipped)} refinement "
            "step(s) were not taken because they lay between a best point and a neighbour the evaluation "
            "cannot tell from it (more items, not more candidates, would resolve them)"
        )
    if held is not None:  # beyond --budget: the estimate, not the search
        doc["budget"]["held_out_evaluations"] = held["evaluations_run"] + held["from_cache"]
    if held is not None and held.get("status") != "ok":
        doc["warnings"].append(f"no held-out estimate of the winner: {held.get('message')}")
    doc["output"]["checkpoint_bytes"] = dir_bytes(final)
    plot, skipped = (
        sweep_report.plot(s, final, winner) if s.opts.plot else (None, "not asked for (plot=False)")
    )
    doc["plot"] = plot
    if skipped is not None:
        doc["plot_skipped"] = skipped
        if s.opts.plot:
            doc["warnings"].append(f"no frontier plot: {skipped}")
    write_json(final / SWEEP_REPORT, doc)
    move_into_place(s, final)
    shutil.rmtree(s.stage, ignore_errors=True)
    return doc


def move_into_place(s: SweepState, final: Path) -> None:
    swap_dir_into_place(final, s.out, overwrite=s.opts.overwrite, during="the sweep ran")


# -- everything


def run(s: SweepState) -> dict:
    s.t0 = time.perf_counter()
    setup.validate(s)
    lock = OutLock(s.out)
    try:
        setup.open_inputs(s)
        lock.acquire()
        # before anything is written: a cluster that cannot be reached is exit 2 with OUT untouched
        s.executor = make_executor(s.opts, s.slots)
        started = s.stage.exists()
        s.stage.mkdir(parents=True, exist_ok=True)
        s.cache = Cache(s.stage)
        st = os.stat(s.stage)
        s.stage_identity = (st.st_dev, st.st_ino)
        if started:
            s.emit(kind="info", message=f"resuming: reusing the evaluations cached in {s.stage}")
        try:
            s.ft_rfs = []
            steps.references(s)
            steps.rescore(s)
            compare.warn_resolution(s)
            search(s)
            return finish(s)
        except KeyboardInterrupt:
            raise Interrupted(
                f"interrupted; {s.run_count + s.cached_count} finished evaluation(s) are cached in {s.stage}",
                hint="run the same command again to resume",
            ) from None
        except (InputError, CheckFailed):
            if not started:  # a cache from an interrupted run stays for the corrected command
                shutil.rmtree(s.stage, ignore_errors=True)
            raise
        except RuntimeFailure:
            raise
    finally:
        if s.executor is not None:
            s.executor.close()
        setup.close(s)
        lock.release()


def sweep(base: str | Path, ft: str | Path, out: str | Path, options: SweepOptions) -> dict:
    """Sweep candidate repairs of FT against BASE, judged by ``options.eval_template``; OUT gets
    the winner's checkpoint and ``sweep_report.json``. Returns the report document.

    Raises InputError (bad input, a template without ``{model}``, a failing reference
    evaluation), Interrupted (the staging directory is kept: rerun to resume). A candidate
    that cannot be evaluated is reported, not raised. The caller judges ``doc["gate"]`` and
    ``doc["winner"]`` (None: nothing qualified).

    Example::

        from dghard_cli import SweepOptions, sweep
        doc = sweep("base/", "ft/", "best/", SweepOptions(eval_template="./eval.sh {model} {output}", budget=8))
        print(doc["winner"]["reproduce"]["command"] if doc["winner"] else doc["no_winner_reason"])
    """
    return run(SweepState.create(str(base), str(ft), Path(out), options))
