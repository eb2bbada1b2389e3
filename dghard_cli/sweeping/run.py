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
   ``min_target_retention`` % of the fine-tune's gain (when a bar is in force); candidates within ``tie_tolerance``
   points of the best HM are tied and the one *closest to the fine-tune* wins: the smallest
   ‖W_c − W_ref‖ / ‖W_ref − W_base‖ over all floating tensors, with W_ref = FT (several
   fine-tunes: W_base + Σ_i Δ_i, every fine-tune's whole update), measured on the written
   checkpoint (a LoRA adapter as BASE + ΔW, as FT is read); then the earlier evaluated.
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

The steps live in their own modules: :mod:`.steps` (references and candidates evaluated),
:mod:`.cache`, :mod:`.choose` (the winner and the distance to the fine-tune), :mod:`.report`;
this module holds the options, the setup and the loop.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dghard_cli._version import __version__
from dghard_cli.errors import CheckFailed, InputError, Interrupted, RuntimeFailure
from dghard_cli.io.atomic import swap_dir_into_place
from dghard_cli.io.checkpoint import Checkpoint
from dghard_cli.io.hub import open_checkpoint
from dghard_cli.io.lock import OutLock
from dghard_cli.io.output import check_out_path
from dghard_cli.io.paths import Output, check_outputs
from dghard_cli.lora.source import is_adapter, open_ft
from dghard_cli.scoring.experts import expert_reference
from dghard_cli.scoring.metrics import score_candidates
from dghard_cli.scoring.results import MetricRule, ResultFile, Score
from dghard_cli.sweeping import integrity, merges
from dghard_cli.sweeping.cache import Cache, dir_bytes, input_identity, write_json
from dghard_cli.sweeping.candidate_file import load_candidates, parse_candidates
from dghard_cli.sweeping.candidates import (  # noqa: F401 (where the reproduction command writes)
    REPRODUCED_SUFFIX,
    Candidate,
    FamilyEntry,
    reproduced_out,
)
from dghard_cli.sweeping.choose import choose_winner, objective, target_ok
from dghard_cli.sweeping.defaults import DEFAULT_BUDGET, DEFAULT_MIN_TARGET_RETENTION
from dghard_cli.sweeping.evaluate import check_template
from dghard_cli.sweeping.execution import make_executor, plan_execution
from dghard_cli.sweeping.families import check_entry, degenerate_on_adapters
from dghard_cli.sweeping.lines import bind_entries as bind_lines
from dghard_cli.sweeping.report import FRONTIER_PNG, SCHEMA_VERSION, SweepReport  # noqa: F401 (names of the output)
from dghard_cli.sweeping.search import coarse_allotment, coarse_order, next_round
from dghard_cli.sweeping.steps import EvaluationSteps

SWEEP_REPORT = "sweep_report.json"
STAGING_SUFFIX = ".dghard-sweep"


def effective_bar(min_target_retention: float | None, n_fts: int) -> float | None:
    """The target bar in force: the one given, else 90 % with one fine-tune and none with several
    (there the targets are part of % retention, so HM already weighs them)."""
    if min_target_retention is not None:
        return min_target_retention
    return DEFAULT_MIN_TARGET_RETENTION if n_fts == 1 else None


@dataclass
class SweepOptions:
    """What to try, how to evaluate it and how to choose."""

    eval_template: str
    targets: list[str] = field(default_factory=list)
    budget: int = DEFAULT_BUDGET
    candidates: Path | None = None  # candidate file; None: the built-in default set
    families: list[dict] | None = None  # the candidate file's ``families`` list, inline
    base_results: Path | None = None
    ft_results: list[Path] = field(default_factory=list)  # FT's, then each extra fine-tune's
    extra_fts: list[str] = field(default_factory=list)  # more fine-tunes of BASE: merge families
    eval_timeout: float | None = None
    lm_eval: dict | None = None  # --lm-eval: tasks, backend, args (sweep/lm_eval.py), for the report
    min_target_retention: float | None = None  # None: effective_bar's default
    fail_under: float | None = None
    margin: float | None = None
    metric: list[str] | None = None
    units: str = "auto"  # auto | fraction | points: how every results file's numbers are read
    tie_tolerance: float = 0.0
    device: str = "auto"
    #: output dtype of every candidate's floating tensors (``--dtype``, a safetensors name such as
    #: BF16); None: each command's default (the fine-tune's)
    dtype: str | None = None
    overwrite: bool = False
    argv: list[str] | None = None
    plot: bool = True
    refine: list[str] = field(default_factory=list)  # "groups": per-group refinement of lines
    on_event: Callable[[dict], None] | None = None  # progress (the CLI prints these)
    # execution (sweep/executors.py): how many evaluations at once, where
    jobs: int | None = None  # None: one, or one per --devices entry
    devices: list[str] | None = None  # one per running evaluation (CUDA_VISIBLE_DEVICES, {device})
    executor: str = "local"  # "local" | "ray"
    ray_address: str | None = None  # None: a local Ray cluster; "auto", "HOST:PORT", "ray://HOST:PORT"
    eval_resources: str | None = None  # Ray resources per evaluation, e.g. "gpu=1,cpu=4"
    keep_candidates: bool = False  # keep every evaluated candidate in OUT/candidates/


def staging_path(out: Path) -> Path:
    out = Path(out).expanduser().absolute()
    return out.parent / f".{out.name}{STAGING_SUFFIX}"


# -- distance to the fine-tune ---------------------------------------------------------------


# -- choosing ----------------------------------------------------------------------------------


# -- the sweep ---------------------------------------------------------------------------------


class _Sweep(EvaluationSteps, SweepReport):
    def __init__(self, base: str, ft: str, out: Path, opts: SweepOptions) -> None:
        self.base_spec, self.ft_specs = str(base), [str(ft), *map(str, opts.extra_fts)]
        self.out_arg = str(out)
        self.out = Path(out).expanduser().absolute()
        self.opts = opts
        self.stage = staging_path(self.out)
        self.rule = MetricRule.parse(opts.metric)
        self.rows: list[dict] = []  # every candidate considered, in order
        self.rf: dict[str, ResultFile] = {}  # candidate key -> results
        self.records: dict[str, dict] = {}  # candidate key -> cache record
        self.cands: dict[str, Candidate] = {}
        self.refs: dict[str, dict] = {}
        self.disk_peak = 0
        self.run_count = 0
        self.cached_count = 0
        self.t = {"write": 0.0, "distance": 0.0, "eval": 0.0}
        self.warnings: list[str] = []
        self.running: dict[str, dict] = {}  # job key -> name, start time, slot, device
        self.queued: list[str] = []  # the names of the round being evaluated
        self.executor = None
        # several fine-tunes: each benchmark's expert (score/experts.py)
        self.expert_ref: ResultFile | dict[str, Score] | None = None
        self.expert_choice: dict[str, dict] = {}

    # -- events
    def emit(self, **ev) -> None:
        if self.opts.on_event is not None:
            self.opts.on_event(ev)

    # -- setup
    def validate(self) -> None:
        o = self.opts
        check_template(o.eval_template)
        if isinstance(o.budget, bool) or not isinstance(o.budget, int) or o.budget < 1:
            raise InputError(f"--budget must be a whole number >= 1, got {o.budget!r}")
        if o.eval_timeout is not None and not (math.isfinite(o.eval_timeout) and o.eval_timeout > 0):
            raise InputError(f"--eval-timeout must be a number of seconds > 0, got {o.eval_timeout}")
        for name, v in (
            ("--min-target-retention", o.min_target_retention),
            ("--tie-tolerance", o.tie_tolerance),
        ):
            if v is not None and not math.isfinite(v):
                raise InputError(f"{name} must be finite, got {v}")
        if o.tie_tolerance < 0:
            raise InputError(f"--tie-tolerance must be >= 0 points, got {o.tie_tolerance}")
        if o.margin is not None and not (math.isfinite(o.margin) and o.margin >= 0):
            raise InputError(f"--margin must be a finite number >= 0, got {o.margin}")
        if o.fail_under is not None and not math.isfinite(o.fail_under):
            raise InputError(f"--fail-under must be finite, got {o.fail_under}")
        if len(o.ft_results) > len(self.ft_specs):
            raise InputError(
                f"--ft-results given {len(o.ft_results)} times but there are {len(self.ft_specs)} fine-tune(s)"
            )
        for p in [o.base_results, *o.ft_results]:
            if p is not None and not Path(p).expanduser().exists():
                raise InputError(f"results {p}: no such file or directory")
        from dghard_cli.scoring.results import SCALES

        if o.dtype is not None:
            from dghard_cli.io.safetensors_format import parse_dtype_option

            o.dtype = parse_dtype_option(o.dtype)

        if o.units not in SCALES:
            raise InputError(f"--units {o.units!r} is not one of {', '.join(SCALES)}")
        for r in o.refine:
            if r != "groups":
                raise InputError(f"--refine {r!r} is not one of: groups")
        self.slots, self.devices = plan_execution(o)
        if o.families is not None:
            self.entries = parse_candidates({"families": o.families}, "SweepOptions.families")
            self.candidates_source = "SweepOptions.families"
        else:
            self.entries, self.candidates_source = load_candidates(o.candidates)

    def open_inputs(self) -> None:
        self.base_ck = open_checkpoint(self.base_spec, label="BASE")
        self.ft_cks: list[Checkpoint] = []
        for i, spec in enumerate(self.ft_specs):
            label = "FT" if i == 0 else f"--merge-ft {spec}"
            self.ft_cks.append(open_ft(spec, base=self.base_ck, label=label))
        # LoRA adapters: evaluated as full merged checkpoints; each candidate written as an adapter
        # where that is exact, else merged (steps.py, families.writes_adapter)
        self.adapters = any(is_adapter(f) for f in self.ft_cks)
        check_out_path(
            self.out, [self.base_ck.path, *[f.path for f in self.ft_cks]], overwrite=self.opts.overwrite
        )
        given = [("--base-results", self.opts.base_results)]
        given += [("--ft-results", r) for r in self.opts.ft_results]
        check_outputs(given, [Output("OUT", self.out, is_dir=True, replaces=True)])
        if self.stage.exists() and not self.stage.is_dir():
            raise InputError(f"{self.stage} exists and is not a directory; remove it")
        n = len(self.ft_cks)
        self.bar = effective_bar(self.opts.min_target_retention, n)
        self.active: list[FamilyEntry] = []
        self.skipped: list[dict] = []
        for e in self.entries:
            if self.adapters and degenerate_on_adapters(e):
                self.skipped.append(
                    {
                        **e.describe(),
                        "skipped": "a LoRA adapter's update has only r non-zero singular values, so the "
                        "unknown-noise cut is undefined on it",
                    }
                )
            elif e.applies(n) and e.origin == "merges":
                try:  # one entry per registered method: one that cannot take these inputs is skipped
                    check_entry(e, n, f"{self.candidates_source}: merges ({e.family})")
                except InputError as exc:
                    self.skipped.append({**e.describe(), "skipped": str(exc)})
                else:
                    self.active.append(e)
            elif e.applies(n):
                check_entry(e, n, f"{self.candidates_source}: families[{e.index}] ({e.family})")
                self.active.append(e)
            else:
                self.skipped.append(
                    {
                        **e.describe(),
                        "skipped": f"applies with {e.fine_tunes or e.kind.default_when} fine-tune(s), given {n}",
                    }
                )
        if not self.active:
            raise InputError(
                f"{self.candidates_source}: no candidate family applies to {n} fine-tune(s) "
                "(repair shrinkers and wise-ft take one; the other merge methods apply with several)"
            )
        self.warnings += bind_lines(
            self.active,
            self.skipped,
            self.base_ck,
            self.ft_cks[0],
            refine_groups="groups" in self.opts.refine,
        )
        self.identity = {
            "base": input_identity(self.base_ck),
            "fts": [input_identity(f) for f in self.ft_cks],
            "template": self.opts.eval_template,
            "dghard": __version__,
        }
        self.n_ref_evals = (self.opts.base_results is None) + sum(
            1 for i in range(n) if i >= len(self.opts.ft_results)
        )
        self.cand_budget = self.opts.budget - self.n_ref_evals
        if self.cand_budget < 1:
            raise InputError(
                f"--budget {self.opts.budget} leaves no evaluation for a candidate: evaluating BASE and the "
                f"fine-tune(s) takes {self.n_ref_evals} (give --base-results/--ft-results, or a larger --budget)"
            )

    def close(self) -> None:
        for ck in [getattr(self, "base_ck", None), *getattr(self, "ft_cks", [])]:
            if ck is not None:
                ck.close()

    # -- scoring
    def ft_reference(self) -> ResultFile | dict[str, Score]:
        """FT's results; several fine-tunes: each benchmark's expert (:mod:`dghard_cli.scoring.experts`)."""
        if len(self.ft_rfs) == 1:
            return self.ft_rfs[0]
        if self.expert_ref is None:
            self.expert_ref, self.expert_choice = expert_reference(
                self.base_rf, self.ft_rfs, targets=self.opts.targets, margin=self.opts.margin
            )
        return self.expert_ref

    def rescore(self) -> None:
        refs: list[tuple[str, object]] = [("BASE", self.base_rf)]
        refs += [("FT" if i == 0 else f"FT #{i + 1}", rf) for i, rf in enumerate(self.ft_rfs)]
        scored = [(r["name"], self.rf[r["key"]]) for r in self.rows if r["status"] == "ok"]
        doc = score_candidates(
            self.base_rf,
            self.ft_reference(),
            refs + scored,
            targets=self.opts.targets,
            margin=self.opts.margin,
            targets_in_retention=len(self.ft_rfs) > 1,
            unchanged_in_repair=len(self.ft_rfs) > 1,
            units_option="--units",  # the sweep's own option forces a unit
        )
        by_name = {c["name"]: c for c in doc["candidates"]}
        self.score_doc = doc
        self.ref_scores = {n: by_name[n] for n, _ in refs}
        for r in self.rows:
            cd = by_name.get(r["name"]) if r["status"] == "ok" else None
            r["score"] = cd
            for k in (
                "repair",
                "retention",
                "hm",
                "unchanged_mean_change",
                "target_retention",
                "target_retention_mean",
            ):
                r[k] = cd[k] if cd else None
            r["feasible"] = bool(cd) and target_ok(cd, self.bar)
            r["objective"] = objective(cd, r["distance"], self.bar)

    # -- the loop
    def round_in(self, entries: list[FamilyEntry], budget: int) -> list[tuple[Candidate, str]]:
        """The next round among ``entries`` (coarse grid, then refinement, as if they had
        ``budget`` evaluations of their own), cut to what is left of ``budget``."""
        n = len(self.ft_cks)
        coarse = coarse_order(entries, n)
        allot = coarse_allotment(max(1, budget), len(coarse), len(entries))
        coarse_keys = {c.params for c in coarse}
        evaluated = {self.cands[r["key"]].params: r["objective"] for r in self.rows}
        done = sum(1 for r in self.rows if self.cands[r["key"]].params in coarse_keys)

        def rank(e: FamilyEntry) -> tuple | None:
            objs = [r["objective"] for r in self.rows if r["entry"] == e.index and r["objective"] is not None]
            return max(objs) if objs else None

        return next_round(entries, n, coarse, evaluated, done, allot, rank)

    def search(self) -> None:
        """The entries' search, round by round; with ``merges:`` follow-ups (sweep/merges.py),
        the strength search first (all but the follow-ups' reserve), then the follow-ups of the
        best merge, then whatever the strength search has left."""
        first = list(self.active)
        reserve = merges.followup_reserve(first, self.cand_budget)
        later: list[FamilyEntry] | None = None if reserve else []
        later_budget = 0
        while len(self.rows) < self.cand_budget:
            first_room = self.cand_budget - reserve - len(self.rows)
            if later is None and (first_room <= 0 or not self.round_in(first, self.cand_budget - reserve)):
                later = self.derive_followups()
                self.active += later
                later_budget = self.cand_budget - len(self.rows)
            batch: list[tuple[Candidate, str]] = []
            if later:
                batch = [
                    (c, "follow-up" if phase == "coarse" else phase)  # a follow-up's own grid point
                    for c, phase in self.round_in(later, later_budget)
                ]
            if not batch:
                batch = self.round_in(first, self.cand_budget - reserve)
                if later is None:
                    batch = batch[: max(0, first_room)]
            if not batch:
                break
            self.evaluate_round(batch[: self.cand_budget - len(self.rows)])

    def derive_followups(self) -> list[FamilyEntry]:
        """The follow-up entries of the ``merges:`` entries' best merges so far (none if none):
        the best one's, then those of every other family within noise of it
        (:func:`merges.followup_families`)."""
        by_index = {e.index: e for e in self.active}
        rows = [
            r
            for r in self.rows
            if r["objective"] is not None and by_index.get(r["entry"]) and by_index[r["entry"]].followups
        ]
        start = max((e.index for e in self.active), default=-1) + 1
        out: list[FamilyEntry] = []
        top = max(rows, key=lambda r: (r["objective"], -r["order"]), default=None)
        dens = merges.density_followup_size(by_index[top["entry"]]) if top is not None else 0
        near = merges.followup_families(rows, self.opts.tie_tolerance, self.cand_budget, dens)
        for k, best in enumerate(near):
            entries, notes = merges.followups(
                by_index[best["entry"]],
                self.cands[best["key"]],
                start + len(out),
                self.base_ck,
                self.ft_cks[0],
                density=k == 0,
            )
            self.warnings += [n for n in notes if n not in self.warnings]
            out += entries
        for e in out:
            self.emit(kind="info", message=f"{e.origin}")
        return out

    # -- output
    def finish(self) -> dict:
        winner, reason = choose_winner(self.rows, self.bar, self.opts.tie_tolerance)
        shutil.rmtree(self.stage / "jobs", ignore_errors=True)
        final = self.stage / "final"
        shutil.rmtree(final, ignore_errors=True)
        regenerated = False
        if winner is not None:
            wdir = self.stage / "winner"
            kept = self.on_disk(wdir, winner["key"])
            problem = "it was not kept on disk" if kept is None else None
            if kept is not None:
                problem = integrity.verify_hashes(wdir, kept.get("snapshot"))
                problem = problem and f"it changed on disk: {problem}"
            if problem:
                # what stage/winner holds lost after all (several at a time, a tie tolerance or
                # the units of later results can reorder the winner): kept, or deleted
                if kept is None:
                    self.drop(wdir)
                else:  # the winner itself, changed by the evaluation: never kept
                    shutil.rmtree(wdir, ignore_errors=True)
                if not self.from_kept(winner["key"], wdir):
                    self.emit(kind="info", message=f"writing the winner {winner['name']} again ({problem})")
                    self.write(self.cands[winner["key"]], winner["key"], wdir)
                    regenerated = True
            os.replace(wdir, final)
            (self.stage / "winner.key").unlink(missing_ok=True)
        else:
            shutil.rmtree(self.stage / "winner", ignore_errors=True)
            (self.stage / "winner.key").unlink(missing_ok=True)
            final.mkdir()
        kept = self.stage / "kept"
        if self.opts.keep_candidates and kept.is_dir():
            for keyfile in kept.glob("*.key"):
                keyfile.unlink()
            os.replace(kept, final / "candidates")
        doc = self.report(winner, reason, regenerated)
        doc["output"]["checkpoint_bytes"] = dir_bytes(final)
        plot, skipped = self.plot(final, winner) if self.opts.plot else (None, "not asked for (plot=False)")
        doc["plot"] = plot
        if skipped is not None:
            doc["plot_skipped"] = skipped
            if self.opts.plot:
                doc["warnings"].append(f"no frontier plot: {skipped}")
        write_json(final / SWEEP_REPORT, doc)
        self.move_into_place(final)
        shutil.rmtree(self.stage, ignore_errors=True)
        return doc

    def move_into_place(self, final: Path) -> None:
        swap_dir_into_place(final, self.out, overwrite=self.opts.overwrite, during="the sweep ran")

    # -- everything
    def run(self) -> dict:
        self.t0 = time.perf_counter()
        self.validate()
        lock = OutLock(self.out)
        try:
            self.open_inputs()
            lock.acquire()
            # before anything is written: a cluster that cannot be reached is exit 2 with OUT untouched
            self.executor = make_executor(self.opts, self.slots)
            started = self.stage.exists()
            self.stage.mkdir(parents=True, exist_ok=True)
            self.cache = Cache(self.stage)
            st = os.stat(self.stage)
            self.stage_identity = (st.st_dev, st.st_ino)
            if started:
                self.emit(kind="info", message=f"resuming: reusing the evaluations cached in {self.stage}")
            try:
                self.ft_rfs = []
                self.references()
                self.rescore()
                self.search()
                return self.finish()
            except KeyboardInterrupt:
                raise Interrupted(
                    f"interrupted; {self.run_count + self.cached_count} finished evaluation(s) are cached in {self.stage}",
                    hint="run the same command again to resume",
                ) from None
            except (InputError, CheckFailed):
                if not started:  # a cache from an interrupted run stays for the corrected command
                    shutil.rmtree(self.stage, ignore_errors=True)
                raise
            except RuntimeFailure:
                raise
        finally:
            if self.executor is not None:
                self.executor.close()
            self.close()
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
    return _Sweep(str(base), str(ft), Path(out), options).run()
