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
   ``min_target_retention`` % of the fine-tune's gain; candidates within ``tie_tolerance``
   points of the best HM are tied and the one *closest to the fine-tune* wins: the smallest
   ‖W_c − W_ref‖ / ‖W_ref − W_base‖ over all floating tensors, with W_ref = FT (several
   fine-tunes: W_base + Σ_i Δ_i, every fine-tune's whole update), measured on the written
   checkpoint; then the earlier evaluated.
4. **Output**: OUT receives the winner's checkpoint exactly as the printed command writes it,
   plus ``sweep_report.json`` and, with matplotlib, ``sweep_frontier.png``. Nothing else
   stays on disk. An interrupted sweep keeps ``.OUT.dghard-sweep`` beside OUT: its cache
   (one entry per evaluation, keyed by the candidate's parameters, the inputs' file sizes and
   modification times and the evaluation template) lets the same command resume without
   evaluating anything twice.

With several fine-tunes the reference "FT" score of a benchmark is the best score any of the
fine-tunes reached on it (what an ideal merge would keep), with that fine-tune's stderr.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dghard_cli import __version__
from dghard_cli.errors import CheckFailed, InputError, Interrupted, RuntimeFailure
from dghard_cli.io.atomic import copy_file_atomic, swap_dir_into_place, write_json_atomic
from dghard_cli.io.checkpoint import Checkpoint
from dghard_cli.io.hub import open_checkpoint
from dghard_cli.io.output import check_out_path
from dghard_cli.score.scoring import MetricRule, ResultFile, Score, read_results, score_candidates
from dghard_cli.sweep.candidates import (
    Candidate,
    FamilyEntry,
    check_entry,
    load_candidates,
    parse_candidates,
    reproduce_argv,
    shell_command,
    write_candidate,
)
from dghard_cli.sweep.evaluate import check_template, locate_results, run_command
from dghard_cli.sweep.search import coarse_allotment, coarse_order, next_candidate

SCHEMA_VERSION = 1
SWEEP_REPORT = "sweep_report.json"
FRONTIER_PNG = "sweep_frontier.png"
STAGING_SUFFIX = ".dghard-sweep"
DEFAULT_BUDGET = 16
DEFAULT_MIN_TARGET_RETENTION = 90.0
#: Row blocks of the distance computation (float64 bytes per input block).
DISTANCE_BLOCK_BYTES = 64 * 1024 * 1024


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
    min_target_retention: float = DEFAULT_MIN_TARGET_RETENTION
    fail_under: float | None = None
    margin: float | None = None
    metric: list[str] | None = None
    tie_tolerance: float = 0.0
    device: str = "auto"
    overwrite: bool = False
    argv: list[str] | None = None
    plot: bool = True
    on_event: Callable[[dict], None] | None = None  # progress (the CLI prints these)


#: The printed reproduction command writes to OUT + this (OUT itself holds the winner).
REPRODUCED_SUFFIX = "-reproduced"


def staging_path(out: Path) -> Path:
    out = Path(out).expanduser().absolute()
    return out.parent / f".{out.name}{STAGING_SUFFIX}"


def _digest(doc: object) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:32]


def input_identity(ck: Checkpoint) -> dict:
    """What the cache knows an input by: its resolved path, and each shard's size and mtime."""
    files = []
    for shard in ck.shards:
        st = (ck.path / shard).stat()
        files.append([shard, st.st_size, st.st_mtime_ns])
    return {"path": str(ck.path.resolve()), "files": files}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()) if Path(path).exists() else 0


def _write_json(path: Path, doc: object) -> None:
    write_json_atomic(path, doc, default=str)


class Cache:
    """One JSON record per evaluation (and a copy of its results file), keyed by a digest."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "cache"
        self.dir.mkdir(parents=True, exist_ok=True)

    def get(self, key: str) -> dict | None:
        path = self.dir / f"{key}.json"
        try:
            rec = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(rec, dict) or rec.get("key") != key:
            return None
        if rec.get("results") and not (self.dir / rec["results"]).is_file():
            return None
        return rec

    def put(self, key: str, rec: dict, results: Path | None) -> dict:
        rec = dict(rec, key=key)
        if results is not None:
            name = f"{key}.results.json"
            copy_file_atomic(results, self.dir / name)
            rec["results"] = name
        else:
            rec["results"] = None
        _write_json(self.dir / f"{key}.json", rec)
        return rec

    def results_path(self, rec: dict) -> Path | None:
        return self.dir / rec["results"] if rec.get("results") else None


# -- distance to the fine-tune ---------------------------------------------------------------


def update_distance(base: Checkpoint, fts: list[Checkpoint], cand: Checkpoint) -> float:
    """‖W_c − W_ref‖ / ‖W_ref − W_base‖ over all floating tensors (float64, row blocks).

    W_ref is the fine-tune (several: W_base + Σ_i (W_i − W_base)). Tensors whose shape differs
    from BASE's (a resized vocabulary) compare with the first fine-tune and add nothing to
    the denominator.
    """
    num = den = 0.0
    for name, info in cand.tensors.items():
        if not info.is_float:
            continue
        ft_infos = [f.tensors.get(name) for f in fts]
        if any(t is None or not t.is_float for t in ft_infos):
            continue
        b = base.tensors.get(name)
        same = b is not None and b.is_float and all(t.shape == b.shape == info.shape for t in ft_infos)
        rows = info.shape[0] if info.shape else 0
        width = max(1, info.numel // rows) if rows else 1
        step = max(1, DISTANCE_BLOCK_BYTES // (8 * width))
        spans = [(r, min(rows, r + step)) for r in range(0, rows, step)] if rows else [None]
        for span in spans:
            c = info.read(span).to(torch.float64)
            if not same:
                f0 = ft_infos[0]
                if f0.shape != info.shape:
                    continue
                num += float(torch.sum((c - f0.read(span).to(torch.float64)) ** 2))
                continue
            bb = b.read(span).to(torch.float64)
            if len(fts) == 1:
                ref = ft_infos[0].read(span).to(torch.float64)
            else:
                ref = bb.clone()
                for t in ft_infos:
                    ref += t.read(span).to(torch.float64) - bb
            num += float(torch.sum((c - ref) ** 2))
            den += float(torch.sum((ref - bb) ** 2))
    if den <= 0:
        return 0.0 if num <= 0 else math.inf
    return math.sqrt(num / den)


# -- choosing ----------------------------------------------------------------------------------


def target_ok(cd: dict, min_retention: float) -> bool:
    """Every target whose retention is defined keeps at least ``min_retention`` %."""
    return all(v is None or v >= min_retention for v in cd["target_retention"].values())


def objective(cd: dict | None, distance: float, min_retention: float) -> tuple | None:
    """What the search maximises: feasible first, then HM (infeasible: the worst target's
    retention, so refinement moves toward feasibility), then closeness to the fine-tune."""
    if cd is None:
        return None
    if cd["hm"] is None:
        return (-1, 0.0, -distance)
    if target_ok(cd, min_retention):
        return (1, cd["hm"], -distance)
    worst = min((v for v in cd["target_retention"].values() if v is not None), default=-math.inf)
    return (0, worst, -distance)


def choose_winner(
    rows: list[dict], min_retention: float, tie_tolerance: float
) -> tuple[dict | None, str | None]:
    """The winner among scored candidate rows (``hm``, ``feasible``, ``distance``, ``order``)."""
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return None, "no candidate could be evaluated (see each candidate's status and message)"
    defined = [r for r in ok if r["hm"] is not None]
    if not defined:
        return None, "HM is undefined for every candidate (no damaged and no improved benchmarks)"
    feasible = [r for r in defined if r["feasible"]]
    if not feasible:
        return None, (
            f"no candidate keeps at least {min_retention:g} % of the fine-tune's gain on every target "
            "(--min-target-retention)"
        )
    best = max(r["hm"] for r in feasible)
    tied = [r for r in feasible if r["hm"] >= best - tie_tolerance]
    return min(tied, key=lambda r: (r["distance"], r["order"])), None


# -- the sweep ---------------------------------------------------------------------------------


class _Sweep:
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
            if not math.isfinite(v):
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
        if o.families is not None:
            self.entries = parse_candidates({"families": o.families}, "SweepOptions.families")
            self.candidates_source = "SweepOptions.families"
        else:
            self.entries, self.candidates_source = load_candidates(o.candidates)

    def open_inputs(self) -> None:
        self.base_ck = open_checkpoint(self.base_spec, label="BASE")
        self.ft_cks: list[Checkpoint] = []
        for i, spec in enumerate(self.ft_specs):
            self.ft_cks.append(open_checkpoint(spec, label="FT" if i == 0 else f"--merge-ft {spec}"))
        check_out_path(
            self.out, [self.base_ck.path, *[f.path for f in self.ft_cks]], overwrite=self.opts.overwrite
        )
        if self.stage.exists() and not self.stage.is_dir():
            raise InputError(f"{self.stage} exists and is not a directory; remove it")
        n = len(self.ft_cks)
        self.active: list[FamilyEntry] = []
        self.skipped: list[dict] = []
        for e in self.entries:
            if e.applies(n):
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

    # -- references
    def reference(self, label: str, ck: Checkpoint, given: Path | None, fixed: dict | None) -> ResultFile:
        what = {"base": "BASE", "ft": "FT"}.get(label, f"fine-tune {ck.source}")
        if given is not None:
            rf = read_results(
                given, metric=self.rule, fixed=fixed, label=f"--{'base' if label == 'base' else 'ft'}-results"
            )
            self.refs[label] = {"name": what, "source": "given", "path": str(given), "status": "ok"}
            self.emit(kind="reference", name=what, source="given", path=str(given))
            return rf
        key = _digest(
            {
                "reference": label,
                "input": input_identity(ck),
                "template": self.opts.eval_template,
                "dghard": __version__,
            }
        )
        rec = self.cache.get(key)
        cached = rec is not None
        if rec is None:
            self.emit(kind="evaluating", name=what)
            rec, results = self.run_eval(ck.path.resolve(), what, fixed)
            rec = self.cache.put(key, rec, results)
            self.run_count += 1
        else:
            self.cached_count += 1
        self.refs[label] = {
            "name": what,
            "source": "evaluated",
            "cached": cached,
            "status": rec["status"],
            "message": rec.get("message"),
            "log_tail": rec.get("log_tail"),
            "seconds": rec.get("seconds", {}).get("eval"),
            "model": str(ck.path),
        }
        if rec["status"] != "ok":
            raise InputError(
                f"the evaluation of {what} failed, so there is nothing to compare candidates with: "
                f"{rec.get('message')}",
                hint="fix the --eval command (try it by hand on BASE)",
            )
        rf = read_results(
            self.cache.results_path(rec), metric=self.rule, fixed=fixed, label=f"{what} results"
        )
        self.emit(
            kind="reference",
            name=what,
            source="cached" if cached else "evaluated",
            seconds=self.refs[label]["seconds"],
            benchmarks=len(rf.scores),
        )
        return rf

    def run_eval(self, model: Path, label: str, fixed: dict | None) -> tuple[dict, Path | None]:
        """Run the evaluation command on ``model``; the cache record and the results file."""
        ev = self.stage / "eval"
        shutil.rmtree(ev, ignore_errors=True)
        ev.mkdir(parents=True)
        output = ev / "output"
        run = run_command(
            self.opts.eval_template, model, output, ev / "logs", timeout=self.opts.eval_timeout, label=label
        )
        self.t["eval"] += run.seconds
        rec = {
            "label": label,
            "status": run.status,
            "message": run.message,
            "log_tail": run.log_tail,
            "returncode": run.returncode,
            "seconds": {"eval": round(run.seconds, 3)},
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
        results = None
        if run.status == "ok":
            try:
                path = locate_results(output, run.stdout, uses_output="{output}" in self.opts.eval_template)
                rf = read_results(path, metric=self.rule, fixed=fixed, label=f"results of {label}")
                if fixed is not None:
                    self._check_complete(rf)
                results = path
            except InputError as exc:
                rec["status"] = "unreadable"
                rec["message"] = f"unreadable results: {exc}"
                rec["log_tail"] = None
        return rec, results

    def _check_complete(self, rf: ResultFile) -> None:
        missing = [k for k in self.base_rf.scores if k not in rf.scores]
        if missing:
            raise InputError(
                f"{rf.source}: no score for benchmark {missing[0]!r}"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                + ", which the base results have"
            )

    # -- candidates
    def key(self, cand: Candidate) -> str:
        return _digest(
            {"candidate": [cand.command, list(cand.params)], "device": self.opts.device, **self.identity}
        )

    def reproduce(self, cand: Candidate) -> list[str]:
        # OUT holds the winner when the sweep ends, so the command writes its copy beside it
        return reproduce_argv(
            cand, self.base_spec, self.ft_specs, reproduced_out(self.out_arg), self.opts.device
        )

    def write(self, cand: Candidate, key: str, target: Path) -> dict:
        shutil.rmtree(target, ignore_errors=True)
        t0 = time.perf_counter()
        # the candidate's report names OUT, where the winner ends up: written once, never patched
        write_candidate(
            cand,
            self.base_spec,
            self.ft_specs,
            target,
            device=self.opts.device,
            argv=self.reproduce(cand),
            report_out=self.out_arg,
        )
        secs = time.perf_counter() - t0
        self.t["write"] += secs
        info = {"key": key, "seconds": round(secs, 3), "bytes": dir_bytes(target)}
        _write_json(target.parent / f"{target.name}.key", info)
        return info

    def on_disk(self, target: Path, key: str) -> dict | None:
        try:
            info = json.loads((target.parent / f"{target.name}.key").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return info if isinstance(info, dict) and info.get("key") == key and target.is_dir() else None

    def evaluate(self, cand: Candidate, phase: str) -> None:
        key = self.key(cand)
        order = len(self.rows) + 1
        name, k = cand.label, 2
        while any(r["name"] == name for r in self.rows):  # same label, other parameters
            name, k = f"{cand.label} #{k}", k + 1
        argv = self.reproduce(cand)
        rec = self.cache.get(key)
        cached = rec is not None
        if rec is None:
            self.emit(kind="evaluating", name=name, order=order, budget=self.cand_budget, phase=phase)
            cdir = self.stage / "candidate"
            info = self.on_disk(cdir, key) or self.write(cand, key, cdir)
            t0 = time.perf_counter()
            cand_ck = Checkpoint(cdir, label="candidate")
            try:
                dist = update_distance(self.base_ck, self.ft_cks, cand_ck)
            finally:
                cand_ck.close()
            dsecs = time.perf_counter() - t0
            self.t["distance"] += dsecs
            winner_bytes = dir_bytes(self.stage / "winner")
            self.disk_peak = max(self.disk_peak, winner_bytes + info["bytes"])
            rec, results = self.run_eval(cdir.resolve(), name, self.base_rf.metrics)
            rec.update(
                name=name,
                params=cand.param_dict,
                distance=dist,
                bytes=info["bytes"],
            )
            rec["seconds"].update(write=info["seconds"], distance=round(dsecs, 3))
            rec = self.cache.put(key, rec, results)
            self.run_count += 1
        else:
            self.cached_count += 1
        row = {
            "order": order,
            "name": name,
            "family": cand.family,
            "entry": cand.entry,
            "command": cand.command,
            "axis": cand.axis,
            "value": cand.value,
            "params": cand.param_dict,
            "phase": phase,
            "status": rec["status"],
            "message": rec.get("message"),
            "log_tail": rec.get("log_tail"),
            "cached": cached,
            "seconds": rec.get("seconds", {}),
            "bytes": rec.get("bytes"),
            "distance": rec.get("distance", math.inf),
            "reproduce": {"argv": argv, "command": shell_command(argv), "out": reproduced_out(self.out_arg)},
            "key": key,
        }
        if rec["status"] == "ok":
            try:
                self.rf[key] = read_results(
                    self.cache.results_path(rec),
                    metric=self.rule,
                    fixed=self.base_rf.metrics,
                    label=f"results of {name}",
                )
                self._check_complete(self.rf[key])
            except InputError as exc:
                row["status"], row["message"] = "unreadable", f"unreadable results: {exc}"
                self.rf.pop(key, None)
        self.rows.append(row)
        self.records[key] = rec
        self.cands[key] = cand
        self.rescore()
        self.keep_or_drop(key, cached)
        self.emit(
            kind="candidate",
            row=row,
            order=order,
            budget=self.cand_budget,
            min_target_retention=self.opts.min_target_retention,
        )

    def keep_or_drop(self, key: str, cached: bool) -> None:
        """Keep the candidate just written if it is the best so far, else delete it."""
        cdir = self.stage / "candidate"
        if cached or not cdir.exists():
            return
        winner, _ = choose_winner(self.rows, self.opts.min_target_retention, self.opts.tie_tolerance)
        if winner is not None and winner["key"] == key:
            wdir = self.stage / "winner"
            shutil.rmtree(wdir, ignore_errors=True)
            (self.stage / "winner.key").unlink(missing_ok=True)
            os.replace(cdir, wdir)
            os.replace(self.stage / "candidate.key", self.stage / "winner.key")
        else:
            shutil.rmtree(cdir, ignore_errors=True)
            (self.stage / "candidate.key").unlink(missing_ok=True)

    # -- scoring
    def ft_reference(self) -> ResultFile | dict[str, Score]:
        if len(self.ft_rfs) == 1:
            return self.ft_rfs[0]
        best: dict[str, Score] = {}
        for k in self.base_rf.scores:
            best[k] = max((rf.scores[k] for rf in self.ft_rfs if k in rf.scores), key=lambda s: s.value)
        return best

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
            r["feasible"] = bool(cd) and target_ok(cd, self.opts.min_target_retention)
            r["objective"] = objective(cd, r["distance"], self.opts.min_target_retention)

    # -- the loop
    def search(self) -> None:
        n = len(self.ft_cks)
        coarse = coarse_order(self.active, n)
        allot = coarse_allotment(self.cand_budget, len(coarse), len(self.active))
        coarse_keys = {c.params for c in coarse}
        while len(self.rows) < self.cand_budget:
            evaluated = {self.cands[r["key"]].params: r["objective"] for r in self.rows}
            done = sum(1 for r in self.rows if self.cands[r["key"]].params in coarse_keys)

            def rank(e: FamilyEntry) -> tuple | None:
                objs = [
                    r["objective"] for r in self.rows if r["entry"] == e.index and r["objective"] is not None
                ]
                return max(objs) if objs else None

            nxt = next_candidate(self.active, n, coarse, evaluated, done, allot, rank)
            if nxt is None:
                break
            self.evaluate(*nxt)

    # -- output
    def finish(self) -> dict:
        winner, reason = choose_winner(self.rows, self.opts.min_target_retention, self.opts.tie_tolerance)
        shutil.rmtree(self.stage / "candidate", ignore_errors=True)
        (self.stage / "candidate.key").unlink(missing_ok=True)
        final = self.stage / "final"
        shutil.rmtree(final, ignore_errors=True)
        regenerated = False
        if winner is not None:
            wdir = self.stage / "winner"
            if self.on_disk(wdir, winner["key"]) is None:
                self.emit(
                    kind="info",
                    message=f"writing the winner {winner['name']} again (it was not kept on disk)",
                )
                self.write(self.cands[winner["key"]], winner["key"], wdir)
                regenerated = True
            os.replace(wdir, final)
            (self.stage / "winner.key").unlink(missing_ok=True)
        else:
            shutil.rmtree(self.stage / "winner", ignore_errors=True)
            (self.stage / "winner.key").unlink(missing_ok=True)
            final.mkdir()
        doc = self.report(winner, reason, regenerated)
        doc["output"]["checkpoint_bytes"] = dir_bytes(final)
        plot, skipped = self.plot(final, winner) if self.opts.plot else (None, "not asked for (plot=False)")
        doc["plot"] = plot
        if skipped is not None:
            doc["plot_skipped"] = skipped
            if self.opts.plot:
                doc["warnings"].append(f"no frontier plot: {skipped}")
        _write_json(final / SWEEP_REPORT, doc)
        self.move_into_place(final)
        shutil.rmtree(self.stage, ignore_errors=True)
        return doc

    def move_into_place(self, final: Path) -> None:
        swap_dir_into_place(final, self.out, overwrite=self.opts.overwrite, during="the sweep ran")

    def plot(self, final: Path, winner: dict | None) -> tuple[str | None, str | None]:
        """(the plot's file name in OUT, None) or (None, why there is none)."""
        missing = "matplotlib is not installed (pip install 'dghard[plot]')"
        try:
            from dghard_cli.sweep.plot import frontier_png
        except ImportError:
            return None, missing
        try:
            png = frontier_png(self.rows, winner, self.ref_scores)
        except ImportError:
            return None, missing
        if png is None:
            return None, "% repair or % retention is undefined (no damaged or no improved benchmarks)"
        (final / FRONTIER_PNG).write_bytes(png)
        return FRONTIER_PNG, None

    def report(self, winner: dict | None, reason: str | None, regenerated: bool) -> dict:
        o = self.opts
        rows = []
        for r in self.rows:
            row = {k: v for k, v in r.items() if k not in ("objective", "score", "key")}
            row["benchmarks"] = r["score"]["benchmarks"] if r.get("score") else None
            row["distance"] = (
                None if r["distance"] is None or not math.isfinite(r["distance"]) else r["distance"]
            )
            rows.append(row)
        win = None
        if winner is not None:
            win = {
                k: winner[k]
                for k in (
                    "order",
                    "name",
                    "family",
                    "axis",
                    "value",
                    "params",
                    "hm",
                    "repair",
                    "retention",
                    "unchanged_mean_change",
                    "target_retention",
                    "target_retention_mean",
                    "distance",
                    "reproduce",
                )
            }
            win["rewritten_at_end"] = regenerated
        gate = None
        if o.fail_under is not None:
            hm = winner["hm"] if winner else None
            passed = hm is not None and hm >= o.fail_under
            if winner is None:
                why = f"no winner ({reason}), so the gate at {o.fail_under:g} cannot pass"
            elif passed:
                why = f"winner {winner['name']!r}: HM {hm:.2f} >= {o.fail_under:g}"
            else:
                why = f"winner {winner['name']!r}: HM {hm:.2f} is below --fail-under {o.fail_under:g}"
            gate = {"fail_under": o.fail_under, "hm": hm, "passed": passed, "reason": why}
        refs = dict(self.refs)
        for label, ref in refs.items():
            nm = {"base": "BASE", "ft": "FT"}.get(label, f"FT #{label[2:]}")
            sc = self.ref_scores.get(nm)
            if sc:
                ref.update(repair=sc["repair"], retention=sc["retention"], hm=sc["hm"])
        inputs = {"base": self.base_ck.describe()}
        if len(self.ft_cks) == 1:
            inputs["ft"] = self.ft_cks[0].describe()
        else:
            inputs["fts"] = [f.describe() for f in self.ft_cks]
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": "sweep",
            "tool": {"name": "dghard", "version": __version__},
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "argv": o.argv,
            "inputs": inputs,
            "eval": {"template": o.eval_template, "timeout": o.eval_timeout},
            "options": {
                "targets": list(o.targets),
                "margin": o.margin,
                "metric": o.metric,
                "min_target_retention": o.min_target_retention,
                "tie_tolerance": o.tie_tolerance,
                "fail_under": o.fail_under,
                "device": o.device,
            },
            "candidates_file": self.candidates_source,
            "families": [e.describe() for e in self.active],
            "skipped_families": self.skipped,
            "budget": {
                "total": o.budget,
                "reference_evaluations": self.n_ref_evals,
                "candidate_evaluations": len(self.rows),
                "candidate_budget": self.cand_budget,
                "used": self.n_ref_evals + len(self.rows),
                "run_now": self.run_count,
                "from_cache": self.cached_count,
            },
            "references": refs,
            "benchmarks": self.score_doc["benchmarks"],
            "counts": self.score_doc["counts"],
            "candidates": rows,
            "winner": win,
            "no_winner_reason": reason,
            "gate": gate,
            "disk": {
                "peak_bytes": self.disk_peak,
                "candidate_bytes_max": max((r.get("bytes") or 0 for r in self.rows), default=0),
            },
            "timings": {
                "total": round(time.perf_counter() - self.t0, 3),
                "write": round(self.t["write"], 3),
                "distance": round(self.t["distance"], 3),
                "eval": round(self.t["eval"], 3),
            },
            "output": {"path": self.out_arg},
            "warnings": self.warnings + [w for w in self.score_doc["warnings"]],
        }

    # -- everything
    def run(self) -> dict:
        self.t0 = time.perf_counter()
        self.validate()
        try:
            self.open_inputs()
            started = self.stage.exists()
            self.stage.mkdir(parents=True, exist_ok=True)
            self.cache = Cache(self.stage)
            if started:
                self.emit(kind="info", message=f"resuming: reusing the evaluations cached in {self.stage}")
            try:
                self.base_rf = self.reference("base", self.base_ck, self.opts.base_results, None)
                for t in self.opts.targets:
                    if t not in self.base_rf.scores:
                        raise InputError(
                            f"--target {t!r}: no such benchmark in the base results "
                            f"(benchmarks: {', '.join(self.base_rf.scores)})"
                        )
                self.ft_rfs = []
                for i, ck in enumerate(self.ft_cks):
                    given = self.opts.ft_results[i] if i < len(self.opts.ft_results) else None
                    rf = self.reference("ft" if i == 0 else f"ft{i + 1}", ck, given, self.base_rf.metrics)
                    self._check_complete(rf)
                    self.ft_rfs.append(rf)
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
            self.close()


def reproduced_out(out: str) -> str:
    """Where the printed reproduction command writes: beside OUT (which holds the winner)."""
    return (out.rstrip("/") or out) + REPRODUCED_SUFFIX


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
