"""The steps of a sweep that evaluate: the references (BASE, FT), and each round of candidates
written, measured, evaluated, scored and kept or dropped — several at a time with ``--jobs`` or
a Ray cluster, with the same result as one at a time.

**Scheduling** (:func:`run_jobs`): up to ``slots`` jobs are in flight; a slot
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
from dghard_cli.scoring.experts import expert_reference
from dghard_cli.scoring.metrics import score_candidates
from dghard_cli.scoring.results import ResultFile, Score, read_results
from dghard_cli.sweeping.cache import digest, dir_bytes, input_identity
from dghard_cli.sweeping.candidates import Candidate, reproduced_out, shell_command
from dghard_cli.sweeping.choose import OBJECTIVES, choose_winner, objective, target_ok
from dghard_cli.sweeping.command import CHOOSE_SPLIT, for_split
from dghard_cli.sweeping.compare import compare_with_best
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
from dghard_cli.sweeping.state import CandidateRow, SweepState

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


# -- jobs ----------------------------------------------------------------------------------


def check_stage(s: SweepState) -> None:
    """RuntimeFailure (exit 3) when the staging directory is gone or replaced since the sweep
    began: an evaluation that deleted it left writes failing on vanished paths (an internal
    error) and evaluations in flight reported as "interrupted"."""
    want = s.stage_identity
    try:
        st = os.stat(s.stage)
        cache_ok = (s.stage / "cache").is_dir()
    except OSError:
        st, cache_ok = None, False
    if want is None or (
        st is not None and (st.st_dev, st.st_ino) == want and cache_ok and not s.cache.missing()
    ):
        return
    raise RuntimeFailure(
        f"the sweep's staging directory {s.stage} was removed or replaced while the sweep ran "
        "(by an evaluation command?); its cached evaluations are gone",
        hint="make the evaluation leave the directories above {model} alone, and run the same command again",
    )


def spec_for_job(s: SweepState, spec: str) -> str:
    """An input as a job names it: a local path absolute for a remote worker (whose working
    directory is not this one), a Hub id as given."""
    p = Path(spec).expanduser()
    return str(p.absolute()) if s.remote and p.exists() else spec


def eval_job(s: SweepState, key: str, label: str, **kw) -> Job:
    """A job for ``key``; the template is the sweep's (``{split}`` = ``val``: the split it
    chooses on, :mod:`.holdout`) unless ``template`` is given."""
    return Job(
        key=key,
        label=label,
        template=kw.pop("template", None) or for_split(s.opts.eval_template, CHOOSE_SPLIT),
        timeout=s.opts.eval_timeout,
        workdir=str(s.job_dir(key)),
        base=spec_for_job(s, s.base_spec),
        device=s.opts.device,
        cwd=os.getcwd(),
        **kw,
    )


def _disk_needed(s: SweepState) -> int:
    """What one more candidate may take: the largest so far (with its merged checkpoint, for
    an adapter), or before the first, the largest input."""
    sizes = [(r.get("bytes") or 0) + (r.get("merged_bytes") or 0) for r in s.records.values()]
    guess = max(sizes, default=0) or max(ck.total_bytes for ck in [s.base_ck, *s.ft_cks])
    return int(guess) + DISK_HEADROOM


def _disk_free(s: SweepState) -> int:
    return shutil.disk_usage(s.stage).free


def run_jobs(s: SweepState, jobs: list[Job], on_done: Callable[[Job, JobResult], None]) -> None:
    """Run ``jobs`` on the executor, at most ``slots`` at a time, in order of submission;
    ``on_done`` is called in this thread as each finishes (in order of completion). A job
    whose worker hit the machine's limits (disk full) stops the sweep: RuntimeFailure."""
    from dghard_cli.sweeping.evaluate import KILL_GRACE_S, allow_evaluations, terminate_running

    allow_evaluations()
    queue = list(jobs)
    flight: dict[object, tuple[Job, int]] = {}
    free = list(range(s.executor.slots))

    def finished(handle: object, result: JobResult) -> None:
        job, slot = flight[handle]
        s.running.pop(job.key, None)
        if result.fatal:
            flight.pop(handle)
            raise RuntimeFailure(
                result.fatal, hint="free space (or fix the cause) and run the same command again"
            )
        check_stage(s)
        on_done(job, result)
        # in flight until handled: an interruption in the middle of on_done (before its record
        # is cached) leaves the job there, and the collection below handles it again (a record
        # is cached whole, and caching it twice is the same record)
        flight.pop(handle)
        free.append(slot)
        free.sort()

    try:
        while queue or flight:
            while queue and free:
                job = queue[0]
                if job.write is not None and not _fits(s, job, flight):
                    break  # wait for a running evaluation to free its candidate's space
                queue.pop(0)
                check_stage(s)
                if not s.remote and job.prepared is None:
                    try:  # written (or merged) here, in the main thread, one at a time
                        job = replace(job, prepared=prepare(job))
                    except InputError as exc:
                        on_done(job, prepare_failure(job, exc, remote=False))
                        continue
                    except (OSError, RuntimeFailure):
                        check_stage(s)  # the clearer error when the stage vanished meanwhile
                        raise
                slot = free.pop(0)
                assignment: dict = {"slot": slot}
                if s.devices:
                    assignment["device"] = s.devices[slot]
                if s.remote:
                    assignment["remote"] = True
                s.running[job.key] = {"name": job.label, "since": time.time(), **assignment}
                s.emit(kind="evaluating", name=job.label, reference=job.write is None, slot=slot,
                          device=assignment.get("device"), **progress_doc(s))  # fmt: skip
                flight[s.executor.submit(job, assignment)] = (job, slot)
            if not flight:
                continue
            for handle, result in s.executor.wait(list(flight), timeout=None if not queue else POLL_S):
                finished(handle, result)
    except BaseException:
        # evaluations still running are stopped (their jobs fail, uncached); what finished
        # meanwhile (while this thread wrote a candidate) is collected and cached for the resume
        terminate_running(wait=KILL_GRACE_S + 1)
        deadline = time.monotonic() + (COLLECT_REMOTE_S if s.remote else COLLECT_AFTER_INTERRUPT_S)
        with contextlib.suppress(Exception):
            while flight and time.monotonic() < deadline:
                for handle in list(flight):
                    try:
                        for h, result in s.executor.wait([handle], 0.2 / max(1, len(flight))):
                            finished(h, result)
                    except Exception:  # noqa: BLE001 - the first error is the one raised
                        flight.pop(handle, None)  # failed again: given up, not retried
        if flight:
            s.executor.cancel(list(flight))
        raise


def _fits(s: SweepState, job: Job, flight: dict) -> bool:
    """Whether the candidate of ``job`` fits on the disk now, besides the candidates of the
    jobs in flight that are not written yet (a Ray worker writes its own); RuntimeFailure
    (exit 3) when it cannot fit and nothing running could free space."""
    if job.prepared is not None or written_info(s.job_dir(job.key) / CANDIDATE_DIR, job.key, s.stage):
        return True
    need = _disk_needed(s)
    unwritten = sum(
        1
        for j, _ in flight.values()
        if j.write is not None and not written_info(s.job_dir(j.key) / CANDIDATE_DIR, j.key, s.stage)
    )
    free = _disk_free(s) - unwritten * need
    if free >= need:
        return True
    if flight:
        return False
    raise RuntimeFailure(
        f"not enough free disk space in {s.stage.parent} for the next candidate: about "
        f"{need / 2**20:.0f} MiB needed, {max(free, 0) / 2**20:.0f} MiB free",
        hint="free space (or lower --jobs) and run the same command again to resume",
    )


# -- references


def references(s: SweepState) -> None:
    """BASE's and each fine-tune's results: given, cached, or evaluated (all at once)."""
    specs: list[tuple[str, Checkpoint | None, Path | None]] = [("base", s.base_ck, s.opts.base_results)]
    for i, ck in enumerate(s.ft_cks):
        given = s.opts.ft_results[i] if i < len(s.opts.ft_results) else None
        specs.append(("ft" if i == 0 else f"ft{i + 1}", ck, given))
    jobs, before, recs = [], {}, {}
    for label, ck, given in specs:
        if given is not None:
            continue
        key = digest(
            {
                "reference": label,
                "input": input_identity(ck),
                "template": s.opts.eval_template,
                "dghard": __version__,
            }
        )
        rec = s.cache.get(key)
        if rec is not None:
            recs[label] = (key, rec, True)
            continue
        from dghard_cli.lora.source import is_adapter

        what = _ref_name(label, ck)
        before[label] = input_identity(ck)
        model = spec_for_job(s, ck.source) if is_adapter(ck) else str(ck.path.resolve())
        jobs.append((label, eval_job(s, key, what, model=model, model_is_adapter=is_adapter(ck))))

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
            rec = s.cache.put(job.key, rec, Path(res.results) if res.results else None)
        s.run_count += 1
        recs[label] = (job.key, rec, False)
        shutil.rmtree(s.job_dir(job.key), ignore_errors=True)

    run_jobs(s, [j for _, j in jobs], done)
    fixed = None
    for label, ck, given in specs:
        rf = _reference_results(s, label, ck, given, recs.get(label), fixed)
        if label == "base":
            s.base_rf = rf
            fixed = rf.metrics
            for t in s.opts.targets:
                if t not in rf.scores:
                    raise InputError(
                        f"--target {t!r}: no such benchmark in the base results "
                        f"(benchmarks: {', '.join(rf.scores)})"
                    )
        else:
            _check_complete(s, rf)
            s.ft_rfs.append(rf)


def _ref_name(label: str, ck: Checkpoint) -> str:
    return {"base": "BASE", "ft": "FT"}.get(label, f"fine-tune {ck.source}")


def _reference_results(
    s: SweepState, label: str, ck: Checkpoint, given: Path | None, cached: tuple | None, fixed: dict | None
) -> ResultFile:
    what = _ref_name(label, ck)
    if given is not None:
        rf = read_results(
            given,
            metric=s.rule,
            fixed=fixed,
            scale=s.opts.units,
            label=f"--{'base' if label == 'base' else 'ft'}-results",
        )
        s.refs[label] = {"name": what, "source": "given", "path": str(given), "status": "ok"}
        s.emit(kind="reference", name=what, source="given", path=str(given))
        return rf
    assert cached is not None
    _key, rec, was_cached = cached
    if was_cached:
        s.cached_count += 1
    s.refs[label] = {
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
        s.refs[label]["device"] = rec["device"]
    if not was_cached:
        s.t["eval"] += rec.get("seconds", {}).get("eval") or 0.0
    if rec["status"] != "ok":
        raise InputError(
            f"the evaluation of {what} failed, so there is nothing to compare candidates with: "
            f"{rec.get('message')}",
            hint="fix the --eval command (try it by hand on BASE)",
        )
    rf = read_results(
        s.cache.results_path(rec),
        metric=s.rule,
        fixed=fixed,
        scale=s.opts.units,
        label=f"{what} results",
    )
    s.emit(
        kind="reference",
        name=what,
        source="cached" if was_cached else "evaluated",
        seconds=s.refs[label]["seconds"],
        benchmarks=len(rf.scores),
    )
    return rf


def _check_complete(s: SweepState, rf: ResultFile) -> None:
    missing = [k for k in s.base_rf.scores if k not in rf.scores]
    if missing:
        raise InputError(
            f"{rf.source}: no score for benchmark {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + ", which the base results have"
        )


# -- candidates


def candidate_key(s: SweepState, cand: Candidate) -> str:
    what = {"candidate": [cand.command, list(cand.params)], "device": s.opts.device, **s.identity}
    if s.opts.dtype is not None:  # what is written (absent: the command's default, as before)
        what["dtype"] = s.opts.dtype
    if s.adapters:  # the format is part of what was measured (cached before it was: not reused)
        what["output"] = "peft" if as_adapter(s, cand) else "full"
    return digest(what)


def as_adapter(s: SweepState, cand: Candidate) -> bool:
    """Whether ``cand`` is written as a LoRA adapter (else a full checkpoint)."""
    return writes_adapter(cand, s.ft_cks)


def reproduce(s: SweepState, cand: Candidate) -> list[str]:
    # OUT holds the winner when the sweep ends, so the command writes its copy beside it
    return reproduce_argv(
        cand,
        s.base_spec,
        s.ft_specs,
        reproduced_out(s.out_arg),
        s.opts.device,
        merge_adapters=s.adapters and not as_adapter(s, cand),
        dtype=s.opts.dtype,
    )


def candidate_job(s: SweepState, cand: Candidate, key: str, name: str) -> Job:
    adapter = as_adapter(s, cand)
    return eval_job(
        s,
        key,
        name,
        write=CandidateWrite(
            cand=cand,
            base=spec_for_job(s, s.base_spec),
            fts=tuple(spec_for_job(s, f) for f in s.ft_specs),
            argv=tuple(reproduce(s, cand)),
            report_out=s.out_arg,  # the winner ends up in OUT: its report says so
            merge_adapters=s.adapters and not adapter,
            adapter=adapter,
            dtype=s.opts.dtype,
        ),
    )


def write_candidate_dir(s: SweepState, cand: Candidate, key: str, target: Path) -> dict:
    """Write ``cand`` into ``target`` (the winner, written again at the end)."""
    job = candidate_job(s, cand, key, cand.label)
    shutil.rmtree(s.job_dir(key), ignore_errors=True)
    info = prepare_candidate(job)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(s.job_dir(key) / CANDIDATE_DIR, target)
    os.replace(s.job_dir(key) / f"{CANDIDATE_DIR}.key", target.parent / f"{target.name}.key")
    shutil.rmtree(s.job_dir(key), ignore_errors=True)
    return info


def on_disk(s: SweepState, target: Path, key: str) -> dict | None:
    return written_info(target, key, s.stage)


def evaluate_round(s: SweepState, items: list[tuple[Candidate, str]]) -> None:
    """Evaluate one round of candidates (cached ones are read back); their rows are added in
    the round's order."""
    planned: list[dict] = []
    names = {r["name"] for r in s.rows}
    for i, (cand, phase) in enumerate(items):
        name, k = cand.label, 2
        while name in names:  # same label, other parameters
            name, k = f"{cand.label} #{k}", k + 1
        names.add(name)
        key = candidate_key(s, cand)
        planned.append({"cand": cand, "phase": phase, "key": key, "name": name, "order": len(s.rows) + i + 1})
    s.queued = [p["name"] for p in planned]
    s.emit(kind="round", names=[p["name"] for p in planned], phases=[p["phase"] for p in planned])
    by_key = {p["key"]: p for p in planned}
    finished: dict[str, dict] = {}
    jobs = []
    for p in planned:
        rec = s.cache.get(p["key"])
        if rec is not None:
            shutil.rmtree(s.job_dir(p["key"]), ignore_errors=True)  # left by an interruption
            s.cached_count += 1
            finished[p["key"]] = _add_row(s, p, rec, cached=True)
        else:
            jobs.append(candidate_job(s, p["cand"], p["key"], p["name"]))

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
        s.t["write"] += prep.get("seconds", 0.0) + prep.get("merge_seconds", 0.0)
        s.t["distance"] += prep.get("distance_seconds", 0.0)
        s.t["eval"] += rec["seconds"].get("eval", 0.0)
        winner_bytes = dir_bytes(s.stage / "winner")
        in_flight = sum(dir_bytes(s.job_dir(k) / CANDIDATE_DIR) for k in s.running)
        s.disk_peak = max(
            s.disk_peak,
            winner_bytes + in_flight + (prep.get("bytes") or 0) + prep.get("merged_bytes", 0),
        )
        results = Path(res.results) if res.results else None
        if res.cacheable or rec["status"] == "ok":
            rec = s.cache.put(job.key, rec, results)
        else:
            rec = dict(rec, key=job.key, results=None)
        s.run_count += 1
        finished[job.key] = _add_row(s, p, rec, cached=False)
        keep_or_drop(s, job.key)

    try:
        run_jobs(s, jobs, done)
    finally:
        s.queued = []
        # the round's rows in the round's order, whatever the order of completion
        s.rows.sort(key=lambda r: r["order"])
    rescore(s)


def _add_row(s: SweepState, p: dict, rec: dict, *, cached: bool) -> CandidateRow:
    cand, key, name = p["cand"], p["key"], p["name"]
    argv = reproduce(s, cand)
    row: CandidateRow = {
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
        "reproduce": {"argv": argv, "command": shell_command(argv), "out": reproduced_out(s.out_arg)},
        "key": key,
    }
    if rec.get("device") is not None:
        row["device"] = rec["device"]
    if rec["status"] == "ok":
        try:
            s.rf[key] = read_results(
                s.cache.results_path(rec),
                metric=s.rule,
                fixed=s.base_rf.metrics,
                scale=s.opts.units,
                label=f"results of {name}",
            )
            _check_complete(s, s.rf[key])
        except InputError as exc:
            row["status"], row["message"] = "unreadable", f"unreadable results: {exc}"
            s.rf.pop(key, None)
    s.rows.append(row)
    s.records[key] = rec
    s.cands[key] = cand
    rescore(s)
    s.emit(
        kind="candidate",
        row=row,
        order=row["order"],
        min_target_retention=s.bar,
        **progress_doc(s),
    )
    return row


def keep_or_drop(s: SweepState, key: str) -> None:
    """The candidate just evaluated becomes the winner so far (the previous one is dropped),
    or is dropped; dropped candidates are deleted, or kept for OUT/candidates/."""
    jdir = s.job_dir(key)
    cdir = jdir / CANDIDATE_DIR
    if not cdir.exists():
        shutil.rmtree(jdir, ignore_errors=True)
        return
    winner, _ = choose_winner(s.rows, s.bar, s.opts.tie_tolerance, s.opts.objective, s.opts.tie_rule)
    if winner is not None and winner["key"] == key:
        wdir = s.stage / "winner"
        drop(s, wdir)
        os.replace(cdir, wdir)
        os.replace(jdir / f"{CANDIDATE_DIR}.key", s.stage / "winner.key")
    else:
        drop(s, cdir)
    shutil.rmtree(jdir, ignore_errors=True)


def drop(s: SweepState, cdir: Path) -> None:
    """Delete a candidate that lost, and its key file ``CDIR.key`` (``keep_candidates``: move
    both to ``<stage>/kept/NNN-name``)."""
    from dghard_cli.sweeping import integrity

    keyfile = cdir.parent / f"{cdir.name}.key"
    if s.opts.keep_candidates and cdir.is_dir():
        key = str((key_record(cdir, s.stage) or {}).get("key", ""))
        row = next((r for r in s.rows if key and r["key"] == key), None)
        info = on_disk(s, cdir, key) if key else None
        # a candidate the evaluation wrote into is not what its command writes: never kept
        if row is not None and (info is None or integrity.changed(cdir, info.get("snapshot"))):
            row = None
        if row is not None:
            kept = s.stage / "kept" / f"{row['order']:03d}-{_slug(row['name'])}"
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(kept, ignore_errors=True)
            os.replace(keyfile, kept.parent / f"{kept.name}.key")
            os.replace(cdir, kept)
    shutil.rmtree(cdir, ignore_errors=True)
    keyfile.unlink(missing_ok=True)


def from_kept(s: SweepState, key: str, target: Path) -> bool:
    """Move the kept candidate of ``key`` (``keep_candidates``) to ``target``, if it is there
    intact: the winner chosen at the end may be one that lost while the round ran."""
    from dghard_cli.sweeping import integrity

    kept = s.stage / "kept"
    for keyfile in sorted(kept.glob("*.key")) if kept.is_dir() else []:
        cdir = keyfile.with_suffix("")
        info = on_disk(s, cdir, key)
        if info is not None and integrity.verify_hashes(cdir, info.get("snapshot")) is None:
            os.replace(cdir, target)
            os.replace(keyfile, target.parent / f"{target.name}.key")
            return True
    return False


def progress_doc(s: SweepState) -> dict:
    """Counts and an ETA for progress displays: done, running, queued, best so far."""
    done = len(s.rows)
    secs = [
        r["seconds"].get("eval", 0.0) + r["seconds"].get("write", 0.0)
        for r in s.rows
        if not r.get("cached") and r.get("seconds")
    ]
    left = max(0, s.cand_budget - done - len(s.running))
    slots = max(1, s.executor.slots)
    eta = None
    if secs:
        mean = sum(secs) / len(secs)
        now = time.time()
        running_left = [max(0.0, mean - (now - r["since"])) for r in s.running.values()]
        eta = round(max(running_left, default=0.0) + math.ceil(left / slots) * mean, 1)
    winner, _ = (
        choose_winner(s.rows, s.bar, s.opts.tie_tolerance, s.opts.objective, s.opts.tie_rule)
        if s.rows
        else (None, None)
    )
    finished = {r["name"] for r in s.rows}
    running = [r["name"] for r in s.running.values()]
    return {
        "done": done,
        "budget": s.cand_budget,
        "slots": slots,
        "running": running,
        "queued": sum(1 for n in s.queued if n not in finished and n not in running),
        "best": None if winner is None else best_doc(s, winner),
        "eta_s": eta,
    }


def best_doc(s: SweepState, winner: dict) -> dict:
    """The winner so far, for progress displays: its name, HM, and the objective's value when the
    objective is another (``objective``, ``value``)."""
    doc = {"name": winner["name"], "hm": winner["hm"]}
    if s.opts.objective != "hm":
        doc.update(objective=s.opts.objective, value=winner[OBJECTIVES[s.opts.objective]])
    return doc


# -- scoring
def ft_reference(s: SweepState) -> ResultFile | dict[str, Score]:
    """FT's results; several fine-tunes: each benchmark's expert (:mod:`dghard_cli.scoring.experts`)."""
    if len(s.ft_rfs) == 1:
        return s.ft_rfs[0]
    if s.expert_ref is None:
        s.expert_ref, s.expert_choice = expert_reference(
            s.base_rf, s.ft_rfs, targets=s.opts.targets, margin=s.opts.margin
        )
    return s.expert_ref


def rescore(s: SweepState) -> None:
    refs: list[tuple[str, object]] = [("BASE", s.base_rf)]
    refs += [("FT" if i == 0 else f"FT #{i + 1}", rf) for i, rf in enumerate(s.ft_rfs)]
    scored = [(r["name"], s.rf[r["key"]]) for r in s.rows if r["status"] == "ok"]
    doc = score_candidates(
        s.base_rf,
        ft_reference(s),
        refs + scored,
        targets=s.opts.targets,
        margin=s.opts.margin,
        targets_in_retention=len(s.ft_rfs) > 1,
        unchanged_in_repair=len(s.ft_rfs) > 1,
        units_option="--units",  # the sweep's own option forces a unit
    )
    by_name = {c["name"]: c for c in doc["candidates"]}
    s.score_doc = doc
    s.ref_scores = {n: by_name[n] for n, _ in refs}
    for r in s.rows:
        cd = by_name.get(r["name"]) if r["status"] == "ok" else None
        r["score"] = cd
        for k in (
            "repair",
            "retention",
            "hm",
            "repair_stderr",
            "retention_stderr",
            "hm_stderr",
            "normalised_accuracy",
            "unchanged_mean_change",
            "target_retention",
            "target_retention_mean",
        ):
            r[k] = cd[k] if cd else None
        r["feasible"] = bool(cd) and target_ok(cd, s.bar)
        r["objective"] = objective(cd, r["distance"], s.bar, s.opts.objective)
    compare_with_best(s, refs + scored)
