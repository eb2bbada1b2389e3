"""The steps of a sweep that evaluate: the references (BASE, FT), and each round of candidates
written, measured, evaluated, scored and kept or dropped — several at a time with ``--jobs`` or
a Ray cluster, with the same result as one at a time.

**Scheduling** (:meth:`EvaluationSteps.run_jobs`): up to ``slots`` jobs are in flight; a slot
takes the next job of the round when it frees. With the local executor the sweep's main thread
writes each candidate (one at a time, so one candidate's write is the most the process holds
besides the evaluations, which are other processes) and a thread waits on its evaluation; with
Ray a worker writes and evaluates it (:mod:`dghard_cli.sweeping.jobs`). Every finished evaluation
is cached at once; a round's rows enter the report in the round's order, whatever the order of
completion, so the next round and the winner are those of a sweep that ran one at a time.

**Disk**: a candidate's directory exists from its write until its evaluation is scored, when it
becomes the winner so far (the previous one is deleted) or is deleted (``keep_candidates``: kept
in OUT/candidates/ instead). So at most ``slots`` candidates plus the winner are on disk; before
each write the free space is checked against the largest candidate so far (FT's size before the
first), and the write waits for a running evaluation to free a slot if it does not fit (exit 3
when nothing is running).

LoRA adapters as fine-tunes: each candidate is written in the format its reproduction command
writes (an adapter where it is exact as one, else the merged checkpoint:
:func:`~dghard_cli.sweeping.families.writes_adapter`). Whatever the format, it is measured
and evaluated as the model it stands for: its distance to the fine-tune compares BASE + ΔW
(the adapter read as the fine-tune is, :func:`~dghard_cli.lora.source.open_ft`), and the
evaluation command gets that model as a full checkpoint, as it got FT."""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from dghard_cli._version import __version__
from dghard_cli.errors import InputError, RuntimeFailure
from dghard_cli.io.checkpoint import Checkpoint
from dghard_cli.scoring.results import ResultFile, read_results
from dghard_cli.sweeping.cache import digest, dir_bytes, input_identity
from dghard_cli.sweeping.candidates import Candidate, reproduced_out, shell_command
from dghard_cli.sweeping.choose import choose_winner
from dghard_cli.sweeping.families import reproduce_argv, writes_adapter
from dghard_cli.sweeping.jobs import (
    CANDIDATE_DIR,
    CandidateWrite,
    Job,
    JobResult,
    key_record,
    prepare,
    prepare_candidate,
    prepare_failure,
    written_info,
)

#: Free space kept beyond a candidate's size before writing it.
DISK_HEADROOM = 64 * 1024 * 1024
#: How long the scheduler sleeps between checks while it waits (seconds).
POLL_S = 0.5
#: After an interruption, how long the scheduler waits for the jobs running in this process to
#: hand back their results (their evaluations are being taken down, so each returns within the
#: kill grace period; one that had finished is cached). A fixed 2 s lost finished evaluations on
#: a busy machine, where a thread handed back its result later: the resume evaluated them again.
COLLECT_AFTER_INTERRUPT_S = 30.0
#: The same for a remote executor, whose jobs are cancelled instead.
COLLECT_REMOTE_S = 2.0


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=,_-]+", "_", text).strip("_")[:80] or "candidate"


class EvaluationSteps:
    """Evaluating references and candidates (a part of ``run._Sweep``; the attributes it uses are set up there)."""

    # -- jobs ----------------------------------------------------------------------------------
    def job_dir(self, key: str) -> Path:
        return self.stage / "jobs" / key

    def check_stage(self) -> None:
        """RuntimeFailure (exit 3) when the staging directory is gone or replaced since the sweep
        began: an evaluation that deleted it left writes failing on vanished paths (an internal
        error) and evaluations in flight reported as "interrupted"."""
        want = getattr(self, "stage_identity", None)
        try:
            st = os.stat(self.stage)
            cache_ok = (self.stage / "cache").is_dir()
        except OSError:
            st, cache_ok = None, False
        if want is None or (
            st is not None and (st.st_dev, st.st_ino) == want and cache_ok and not self.cache.missing()
        ):
            return
        raise RuntimeFailure(
            f"the sweep's staging directory {self.stage} was removed or replaced while the sweep ran "
            "(by an evaluation command?); its cached evaluations are gone",
            hint="make the evaluation leave the directories above {model} alone, and run the same command again",
        )

    @property
    def remote(self) -> bool:
        return bool(getattr(self.executor, "remote", False))

    def spec_for_job(self, spec: str) -> str:
        """An input as a job names it: a local path absolute for a remote worker (whose working
        directory is not this one), a Hub id as given."""
        p = Path(spec).expanduser()
        return str(p.absolute()) if self.remote and p.exists() else spec

    def eval_job(self, key: str, label: str, **kw) -> Job:
        return Job(
            key=key,
            label=label,
            template=self.opts.eval_template,
            timeout=self.opts.eval_timeout,
            workdir=str(self.job_dir(key)),
            base=self.spec_for_job(self.base_spec),
            device=self.opts.device,
            cwd=os.getcwd(),
            **kw,
        )

    def _disk_needed(self) -> int:
        """What one more candidate may take: the largest so far (with its merged checkpoint, for
        an adapter), or before the first, the largest input."""
        sizes = [(r.get("bytes") or 0) + (r.get("merged_bytes") or 0) for r in self.records.values()]
        guess = max(sizes, default=0) or max(ck.total_bytes for ck in [self.base_ck, *self.ft_cks])
        return int(guess) + DISK_HEADROOM

    def _disk_free(self) -> int:
        return shutil.disk_usage(self.stage).free

    def run_jobs(self, jobs: list[Job], on_done: Callable[[Job, JobResult], None]) -> None:
        """Run ``jobs`` on the executor, at most ``slots`` at a time, in order of submission;
        ``on_done`` is called in this thread as each finishes (in order of completion). A job
        whose worker hit the machine's limits (disk full) stops the sweep: RuntimeFailure."""
        from dghard_cli.sweeping.evaluate import KILL_GRACE_S, allow_evaluations, terminate_running

        allow_evaluations()
        queue = list(jobs)
        flight: dict[object, tuple[Job, int]] = {}
        free = list(range(self.executor.slots))

        def finished(handle: object, result: JobResult) -> None:
            job, slot = flight.pop(handle)
            free.append(slot)
            free.sort()
            self.running.pop(job.key, None)
            self.check_stage()
            if result.fatal:
                raise RuntimeFailure(
                    result.fatal, hint="free space (or fix the cause) and run the same command again"
                )
            on_done(job, result)

        try:
            while queue or flight:
                while queue and free:
                    job = queue[0]
                    if job.write is not None and not self._fits(job, flight):
                        break  # wait for a running evaluation to free its candidate's space
                    queue.pop(0)
                    self.check_stage()
                    if not self.remote and job.prepared is None:
                        try:  # written (or merged) here, in the main thread, one at a time
                            job = replace(job, prepared=prepare(job))
                        except InputError as exc:
                            on_done(job, prepare_failure(job, exc, remote=False))
                            continue
                        except (OSError, RuntimeFailure):
                            self.check_stage()  # the clearer error when the stage vanished meanwhile
                            raise
                    slot = free.pop(0)
                    assignment: dict = {"slot": slot}
                    if self.devices:
                        assignment["device"] = self.devices[slot]
                    if self.remote:
                        assignment["remote"] = True
                    self.running[job.key] = {"name": job.label, "since": time.time(), **assignment}
                    self.emit(kind="evaluating", name=job.label, reference=job.write is None, slot=slot,
                              device=assignment.get("device"), **self.progress())  # fmt: skip
                    flight[self.executor.submit(job, assignment)] = (job, slot)
                if not flight:
                    continue
                for handle, result in self.executor.wait(list(flight), timeout=None if not queue else POLL_S):
                    finished(handle, result)
        except BaseException:
            # evaluations still running are stopped (their jobs fail, uncached); what finished
            # meanwhile (while this thread wrote a candidate) is collected and cached for the resume
            terminate_running(wait=KILL_GRACE_S + 1)
            deadline = time.monotonic() + (COLLECT_REMOTE_S if self.remote else COLLECT_AFTER_INTERRUPT_S)
            with contextlib.suppress(Exception):
                while flight and time.monotonic() < deadline:
                    for handle, result in self.executor.wait(list(flight), 0.2):
                        with contextlib.suppress(Exception):
                            finished(handle, result)
            if flight:
                self.executor.cancel(list(flight))
            raise

    def _fits(self, job: Job, flight: dict) -> bool:
        """Whether the candidate of ``job`` fits on the disk now, besides the candidates of the
        jobs in flight that are not written yet (a Ray worker writes its own); RuntimeFailure
        (exit 3) when it cannot fit and nothing running could free space."""
        if job.prepared is not None or written_info(
            self.job_dir(job.key) / CANDIDATE_DIR, job.key, self.stage
        ):
            return True
        need = self._disk_needed()
        unwritten = sum(
            1
            for j, _ in flight.values()
            if j.write is not None
            and not written_info(self.job_dir(j.key) / CANDIDATE_DIR, j.key, self.stage)
        )
        free = self._disk_free() - unwritten * need
        if free >= need:
            return True
        if flight:
            return False
        raise RuntimeFailure(
            f"not enough free disk space in {self.stage.parent} for the next candidate: about "
            f"{need / 2**20:.0f} MiB needed, {max(free, 0) / 2**20:.0f} MiB free",
            hint="free space (or lower --jobs) and run the same command again to resume",
        )

    # -- references
    def references(self) -> None:
        """BASE's and each fine-tune's results: given, cached, or evaluated (all at once)."""
        specs: list[tuple[str, Checkpoint | None, Path | None]] = [
            ("base", self.base_ck, self.opts.base_results)
        ]
        for i, ck in enumerate(self.ft_cks):
            given = self.opts.ft_results[i] if i < len(self.opts.ft_results) else None
            specs.append(("ft" if i == 0 else f"ft{i + 1}", ck, given))
        jobs, before, recs = [], {}, {}
        for label, ck, given in specs:
            if given is not None:
                continue
            key = digest(
                {
                    "reference": label,
                    "input": input_identity(ck),
                    "template": self.opts.eval_template,
                    "dghard": __version__,
                }
            )
            rec = self.cache.get(key)
            if rec is not None:
                recs[label] = (key, rec, True)
                continue
            from dghard_cli.lora.source import is_adapter

            what = self._ref_name(label, ck)
            before[label] = input_identity(ck)
            model = self.spec_for_job(ck.source) if is_adapter(ck) else str(ck.path.resolve())
            jobs.append((label, self.eval_job(key, what, model=model, model_is_adapter=is_adapter(ck))))

        by_key = {j.key: label for label, j in jobs}

        def done(job: Job, res: JobResult) -> None:
            label = by_key[job.key]
            ck = dict((lb, c) for lb, c, _ in specs)[label]
            if input_identity(ck) != before[label]:
                raise InputError(
                    f"the evaluation command modified {job.label} ({ck.path}) while evaluating it; "
                    "evaluate {model} without writing into it"
                )
            rec = res.rec
            if res.cacheable or rec["status"] == "ok":
                rec = self.cache.put(job.key, rec, Path(res.results) if res.results else None)
            self.run_count += 1
            recs[label] = (job.key, rec, False)
            shutil.rmtree(self.job_dir(job.key), ignore_errors=True)

        self.run_jobs([j for _, j in jobs], done)
        fixed = None
        for label, ck, given in specs:
            rf = self._reference_results(label, ck, given, recs.get(label), fixed)
            if label == "base":
                self.base_rf = rf
                fixed = rf.metrics
                for t in self.opts.targets:
                    if t not in rf.scores:
                        raise InputError(
                            f"--target {t!r}: no such benchmark in the base results "
                            f"(benchmarks: {', '.join(rf.scores)})"
                        )
            else:
                self._check_complete(rf)
                self.ft_rfs.append(rf)

    @staticmethod
    def _ref_name(label: str, ck: Checkpoint) -> str:
        return {"base": "BASE", "ft": "FT"}.get(label, f"fine-tune {ck.source}")

    def _reference_results(
        self, label: str, ck: Checkpoint, given: Path | None, cached: tuple | None, fixed: dict | None
    ) -> ResultFile:
        what = self._ref_name(label, ck)
        if given is not None:
            rf = read_results(
                given,
                metric=self.rule,
                fixed=fixed,
                scale=self.opts.units,
                label=f"--{'base' if label == 'base' else 'ft'}-results",
            )
            self.refs[label] = {"name": what, "source": "given", "path": str(given), "status": "ok"}
            self.emit(kind="reference", name=what, source="given", path=str(given))
            return rf
        assert cached is not None
        _key, rec, was_cached = cached
        if was_cached:
            self.cached_count += 1
        self.refs[label] = {
            "name": what,
            "source": "evaluated",
            "cached": was_cached,
            "status": rec["status"],
            "message": rec.get("message"),
            "log_tail": rec.get("log_tail"),
            "seconds": rec.get("seconds", {}).get("eval"),
            "model": str(ck.path),
        }
        if rec.get("device") is not None:
            self.refs[label]["device"] = rec["device"]
        if not was_cached:
            self.t["eval"] += rec.get("seconds", {}).get("eval") or 0.0
        if rec["status"] != "ok":
            raise InputError(
                f"the evaluation of {what} failed, so there is nothing to compare candidates with: "
                f"{rec.get('message')}",
                hint="fix the --eval command (try it by hand on BASE)",
            )
        rf = read_results(
            self.cache.results_path(rec),
            metric=self.rule,
            fixed=fixed,
            scale=self.opts.units,
            label=f"{what} results",
        )
        self.emit(
            kind="reference",
            name=what,
            source="cached" if was_cached else "evaluated",
            seconds=self.refs[label]["seconds"],
            benchmarks=len(rf.scores),
        )
        return rf

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
        what = {"candidate": [cand.command, list(cand.params)], "device": self.opts.device, **self.identity}
        if self.opts.dtype is not None:  # what is written (absent: the command's default, as before)
            what["dtype"] = self.opts.dtype
        if self.adapters:  # the format is part of what was measured (cached before it was: not reused)
            what["output"] = "peft" if self.as_adapter(cand) else "full"
        return digest(what)

    def as_adapter(self, cand: Candidate) -> bool:
        """Whether ``cand`` is written as a LoRA adapter (else a full checkpoint)."""
        return writes_adapter(cand, self.ft_cks)

    def reproduce(self, cand: Candidate) -> list[str]:
        # OUT holds the winner when the sweep ends, so the command writes its copy beside it
        return reproduce_argv(
            cand,
            self.base_spec,
            self.ft_specs,
            reproduced_out(self.out_arg),
            self.opts.device,
            merge_adapters=self.adapters and not self.as_adapter(cand),
            dtype=self.opts.dtype,
        )

    def candidate_job(self, cand: Candidate, key: str, name: str) -> Job:
        adapter = self.as_adapter(cand)
        return self.eval_job(
            key,
            name,
            write=CandidateWrite(
                cand=cand,
                base=self.spec_for_job(self.base_spec),
                fts=tuple(self.spec_for_job(f) for f in self.ft_specs),
                argv=tuple(self.reproduce(cand)),
                report_out=self.out_arg,  # the winner ends up in OUT: its report says so
                merge_adapters=self.adapters and not adapter,
                adapter=adapter,
                dtype=self.opts.dtype,
            ),
        )

    def write(self, cand: Candidate, key: str, target: Path) -> dict:
        """Write ``cand`` into ``target`` (the winner, written again at the end)."""
        job = self.candidate_job(cand, key, cand.label)
        shutil.rmtree(self.job_dir(key), ignore_errors=True)
        info = prepare_candidate(job)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(self.job_dir(key) / CANDIDATE_DIR, target)
        os.replace(self.job_dir(key) / f"{CANDIDATE_DIR}.key", target.parent / f"{target.name}.key")
        shutil.rmtree(self.job_dir(key), ignore_errors=True)
        return info

    def on_disk(self, target: Path, key: str) -> dict | None:
        return written_info(target, key, self.stage)

    def evaluate_round(self, items: list[tuple[Candidate, str]]) -> None:
        """Evaluate one round of candidates (cached ones are read back); their rows are added in
        the round's order."""
        planned: list[dict] = []
        names = {r["name"] for r in self.rows}
        for i, (cand, phase) in enumerate(items):
            name, k = cand.label, 2
            while name in names:  # same label, other parameters
                name, k = f"{cand.label} #{k}", k + 1
            names.add(name)
            key = self.key(cand)
            planned.append(
                {"cand": cand, "phase": phase, "key": key, "name": name, "order": len(self.rows) + i + 1}
            )
        self.queued = [p["name"] for p in planned]
        self.emit(kind="round", names=[p["name"] for p in planned], phases=[p["phase"] for p in planned])
        by_key = {p["key"]: p for p in planned}
        finished: dict[str, dict] = {}
        jobs = []
        for p in planned:
            rec = self.cache.get(p["key"])
            if rec is not None:
                shutil.rmtree(self.job_dir(p["key"]), ignore_errors=True)  # left by an interruption
                self.cached_count += 1
                finished[p["key"]] = self._add_row(p, rec, cached=True)
            else:
                jobs.append(self.candidate_job(p["cand"], p["key"], p["name"]))

        def done(job: Job, res: JobResult) -> None:
            p = by_key[job.key]
            rec = dict(res.rec)
            prep = res.prepared or {}
            rec.update(
                name=p["name"],
                params=p["cand"].param_dict,
                distance=prep.get("distance", math.inf),
                bytes=prep.get("bytes"),
            )
            if prep.get("merged_bytes"):
                rec["merged_bytes"] = prep["merged_bytes"]
            rec["seconds"] = {
                **rec.get("seconds", {}),
                **({"write": prep["seconds"]} if "seconds" in prep else {}),
                **({"distance": prep["distance_seconds"]} if "distance_seconds" in prep else {}),
            }
            self.t["write"] += prep.get("seconds", 0.0) + prep.get("merge_seconds", 0.0)
            self.t["distance"] += prep.get("distance_seconds", 0.0)
            self.t["eval"] += rec["seconds"].get("eval", 0.0)
            winner_bytes = dir_bytes(self.stage / "winner")
            in_flight = sum(dir_bytes(self.job_dir(k) / CANDIDATE_DIR) for k in self.running)
            self.disk_peak = max(
                self.disk_peak,
                winner_bytes + in_flight + (prep.get("bytes") or 0) + prep.get("merged_bytes", 0),
            )
            results = Path(res.results) if res.results else None
            if res.cacheable or rec["status"] == "ok":
                rec = self.cache.put(job.key, rec, results)
            else:
                rec = dict(rec, key=job.key, results=None)
            self.run_count += 1
            finished[job.key] = self._add_row(p, rec, cached=False)
            self.keep_or_drop(job.key)

        try:
            self.run_jobs(jobs, done)
        finally:
            self.queued = []
            # the round's rows in the round's order, whatever the order of completion
            self.rows.sort(key=lambda r: r["order"])
        self.rescore()

    def _add_row(self, p: dict, rec: dict, *, cached: bool) -> dict:
        cand, key, name = p["cand"], p["key"], p["name"]
        argv = self.reproduce(cand)
        row = {
            "order": p["order"],
            "name": name,
            "family": cand.family,
            "entry": cand.entry,
            "command": cand.command,
            "axis": cand.axis,
            "value": cand.value,
            "params": cand.param_dict,
            "phase": p["phase"],
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
        if rec.get("device") is not None:
            row["device"] = rec["device"]
        if rec["status"] == "ok":
            try:
                self.rf[key] = read_results(
                    self.cache.results_path(rec),
                    metric=self.rule,
                    fixed=self.base_rf.metrics,
                    scale=self.opts.units,
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
        self.emit(
            kind="candidate",
            row=row,
            order=row["order"],
            min_target_retention=self.bar,
            **self.progress(),
        )
        return row

    def keep_or_drop(self, key: str) -> None:
        """The candidate just evaluated becomes the winner so far (the previous one is dropped),
        or is dropped; dropped candidates are deleted, or kept for OUT/candidates/."""
        jdir = self.job_dir(key)
        cdir = jdir / CANDIDATE_DIR
        if not cdir.exists():
            shutil.rmtree(jdir, ignore_errors=True)
            return
        winner, _ = choose_winner(self.rows, self.bar, self.opts.tie_tolerance)
        if winner is not None and winner["key"] == key:
            wdir = self.stage / "winner"
            self.drop(wdir)
            os.replace(cdir, wdir)
            os.replace(jdir / f"{CANDIDATE_DIR}.key", self.stage / "winner.key")
        else:
            self.drop(cdir)
        shutil.rmtree(jdir, ignore_errors=True)

    def drop(self, cdir: Path) -> None:
        """Delete a candidate that lost, and its key file ``CDIR.key`` (``keep_candidates``: move
        both to ``<stage>/kept/NNN-name``)."""
        from dghard_cli.sweeping import integrity

        keyfile = cdir.parent / f"{cdir.name}.key"
        if self.opts.keep_candidates and cdir.is_dir():
            key = str((key_record(cdir, self.stage) or {}).get("key", ""))
            row = next((r for r in self.rows if key and r["key"] == key), None)
            info = self.on_disk(cdir, key) if key else None
            # a candidate the evaluation wrote into is not what its command writes: never kept
            if row is not None and (info is None or integrity.changed(cdir, info.get("snapshot"))):
                row = None
            if row is not None:
                kept = self.stage / "kept" / f"{row['order']:03d}-{_slug(row['name'])}"
                kept.parent.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(kept, ignore_errors=True)
                os.replace(keyfile, kept.parent / f"{kept.name}.key")
                os.replace(cdir, kept)
        shutil.rmtree(cdir, ignore_errors=True)
        keyfile.unlink(missing_ok=True)

    def from_kept(self, key: str, target: Path) -> bool:
        """Move the kept candidate of ``key`` (``keep_candidates``) to ``target``, if it is there
        intact: the winner chosen at the end may be one that lost while the round ran."""
        from dghard_cli.sweeping import integrity

        kept = self.stage / "kept"
        for keyfile in sorted(kept.glob("*.key")) if kept.is_dir() else []:
            cdir = keyfile.with_suffix("")
            info = self.on_disk(cdir, key)
            if info is not None and integrity.verify_hashes(cdir, info.get("snapshot")) is None:
                os.replace(cdir, target)
                os.replace(keyfile, target.parent / f"{target.name}.key")
                return True
        return False

    def progress(self) -> dict:
        """Counts and an ETA for progress displays: done, running, queued, best so far."""
        done = len(self.rows)
        secs = [
            r["seconds"].get("eval", 0.0) + r["seconds"].get("write", 0.0)
            for r in self.rows
            if not r.get("cached") and r.get("seconds")
        ]
        left = max(0, self.cand_budget - done - len(self.running))
        slots = max(1, self.executor.slots)
        eta = None
        if secs:
            mean = sum(secs) / len(secs)
            now = time.time()
            running_left = [max(0.0, mean - (now - r["since"])) for r in self.running.values()]
            eta = round(max(running_left, default=0.0) + math.ceil(left / slots) * mean, 1)
        winner, _ = choose_winner(self.rows, self.bar, self.opts.tie_tolerance) if self.rows else (None, None)
        finished = {r["name"] for r in self.rows}
        running = [r["name"] for r in self.running.values()]
        return {
            "done": done,
            "budget": self.cand_budget,
            "slots": slots,
            "running": running,
            "queued": sum(1 for n in self.queued if n not in finished and n not in running),
            "best": None if winner is None else {"name": winner["name"], "hm": winner["hm"]},
            "eta_s": eta,
        }
