"""One evaluation of ``dghard sweep`` as a self-contained job, the unit an executor runs.

A :class:`Job` carries everything needed to produce one evaluation record, as plain picklable
data (absolute paths, the candidate's parameters, the template): nothing of the sweep's own
state. So the same function, :func:`run_job`, runs in a thread of the sweep's process (``--jobs
N``) or on a Ray worker on another machine (``--executor ray``, where BASE, FT and the staging
directory are on a file system every node sees at the same path).

A job works in its own directory (``<stage>/jobs/<key>/``)::

    candidate/       the candidate, as its reproduction command writes it (with candidate.key)
    merged/          a LoRA adapter merged into BASE for the evaluation (removed afterwards)
    eval/output      what the evaluation command writes ({output})
    eval/logs/       its stdout and stderr

Steps (:func:`run_job`):

1. **Write** the candidate (unless the sweep already did: the local executor writes in the
   sweep's main thread, one candidate at a time, while other jobs evaluate), snapshot it, and
   measure its distance to the fine-tune (:func:`~dghard_cli.sweeping.choose.update_distance`).
   A candidate that cannot be written (its strengths overflow the output dtype, a worker that
   cannot read BASE) is that job's failure, not the sweep's.
2. **Evaluate**: a LoRA adapter (a reference fine-tune, or a candidate written as one) is merged
   into BASE first, as FT is evaluated; the template runs with ``CUDA_VISIBLE_DEVICES`` set to the
   job's device (``--devices``) and ``{device}`` replaced by it.
3. **Check** that the evaluation left the candidate as written (:mod:`.integrity`).

The sweep reads the results file (on the shared file system) and scores it; the job only
locates it, so a job never needs the sweep's metric rules.
"""

from __future__ import annotations

import datetime as _dt
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from dghard_cli.errors import InputError, RuntimeFailure
from dghard_cli.sweeping import integrity
from dghard_cli.sweeping.candidates import Candidate
from dghard_cli.sweeping.evaluate import interrupted, locate_results, run_command

#: Names inside a job's directory.
CANDIDATE_DIR = "candidate"
MERGED_DIR = "merged"
EVAL_DIR = "eval"


@dataclass(frozen=True)
class CandidateWrite:
    """How to write a candidate: its command's library function and arguments."""

    cand: Candidate
    base: str
    fts: tuple[str, ...]
    argv: tuple[str, ...]  # the reproduction command line its report records
    report_out: str  # the output path its report names (the sweep's OUT)
    merge_adapters: bool  # LoRA fine-tunes written as the full merged checkpoint
    adapter: bool  # written as a LoRA adapter: measured and evaluated as BASE + ΔW
    dtype: str | None = None  # output dtype of floating tensors (--dtype); None: the command's default


@dataclass(frozen=True)
class Job:
    """One evaluation: of a reference model (``model``) or of a candidate (``write``)."""

    key: str
    label: str  # the name shown and given to the command as DGHARD_CANDIDATE
    template: str
    timeout: float | None
    workdir: str  # the job's own directory (see the module docstring)
    base: str  # BASE, as given (a LoRA adapter is merged into it)
    device: str  # --device of writes and merges
    model: str | None = None  # a reference: the directory to evaluate
    model_is_adapter: bool = False  # ``model`` is a LoRA adapter of BASE
    write: CandidateWrite | None = None
    prepared: dict | None = None  # the candidate written already (:func:`prepare_candidate`)
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None  # where the evaluation command runs (the sweep's working directory)


@dataclass
class JobResult:
    """What a job produced: the cache record, where the results file is, the written candidate."""

    key: str
    rec: dict
    results: str | None = None
    prepared: dict | None = None
    cacheable: bool = True  # False: a transient failure (a lost worker), evaluated again on resume
    fatal: str | None = None  # the machine failed (disk full on a worker): the sweep stops, exit 3


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def failed_result(job: Job, message: str, *, cacheable: bool, status: str = "failed") -> JobResult:
    """The record of a job that could not run to its evaluation's end."""
    rec = {
        "label": job.label,
        "status": status,
        "message": message,
        "log_tail": None,
        "returncode": None,
        "seconds": {},
        "created": _now(),
    }
    return JobResult(job.key, rec, None, job.prepared, cacheable=cacheable)


def _merge_adapter(base: str, adapter: str, target: Path, device: str) -> Path:
    """A LoRA adapter of BASE as the full checkpoint an evaluation can load (BASE + ΔW)."""
    from dghard_cli.engine.writer import RunOptions
    from dghard_cli.lora.output import LoraOutputOptions
    from dghard_cli.merging import MergeOptions, merge

    shutil.rmtree(target, ignore_errors=True)
    opts = MergeOptions(
        method="task-arithmetic",
        lora=LoraOutputOptions(merge=True),
        run=RunOptions(device=device, quiet=True),
    )
    merge(base, [adapter], target, opts)
    return target.resolve()


def key_record(target: Path, stage: Path | None = None) -> dict | None:
    """The record in ``target``'s key file (``TARGET.key``, written after the candidate), or None."""
    from dghard_cli.io.files import read_json, realpath

    try:
        info = read_json(
            target.parent / f"{target.name}.key",
            what="key file",
            roots=(realpath(stage or target.parent),),
        )
    except InputError:
        return None
    return info if isinstance(info, dict) else None


def written_info(target: Path, key: str, stage: Path | None = None) -> dict | None:
    """The record of a candidate written into ``target`` for ``key`` (None if there is none)."""
    info = key_record(target, stage)
    return info if info is not None and info.get("key") == key and target.is_dir() else None


def prepare(job: Job) -> dict:
    """Everything before the evaluation: write the candidate (or reuse the one an interrupted
    run left), snapshot it, measure its distance to the fine-tune, and merge a LoRA adapter
    into BASE for the evaluation. Raises what writing raises. Returns what was done, with
    ``model``: the directory the evaluation gets."""
    work = Path(job.workdir)
    work.mkdir(parents=True, exist_ok=True)
    out: dict = {}
    if job.write is not None:
        out = prepare_candidate(job)
        model, adapter = work / CANDIDATE_DIR, job.write.adapter
    else:
        assert job.model is not None
        model, adapter = Path(job.model), job.model_is_adapter
    if adapter:  # evaluated as a full checkpoint, as FT was
        from dghard_cli.sweeping.cache import dir_bytes

        t0 = time.perf_counter()
        try:
            model = _merge_adapter(job.base, str(model), work / MERGED_DIR, job.device)
        except BaseException:
            shutil.rmtree(work / MERGED_DIR, ignore_errors=True)
            raise
        out["merge_seconds"] = round(time.perf_counter() - t0, 3)
        out["merged_bytes"] = dir_bytes(model)
    out["model"] = str(Path(model).resolve())
    return out


def prepare_candidate(job: Job) -> dict:
    """Write the candidate of ``job`` (or reuse the one an interrupted run left), snapshot it
    and measure its distance to the fine-tune. Raises what writing raises."""
    from dghard_cli.io.checkpoint import Checkpoint
    from dghard_cli.io.hub import open_checkpoint
    from dghard_cli.lora.source import open_ft
    from dghard_cli.sweeping.cache import dir_bytes, write_json
    from dghard_cli.sweeping.choose import update_distance
    from dghard_cli.sweeping.families import write_candidate

    w = job.write
    assert w is not None
    target = Path(job.workdir) / CANDIDATE_DIR
    info = written_info(target, job.key)
    if info is None:
        shutil.rmtree(target, ignore_errors=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        try:
            doc = write_candidate(
                w.cand,
                w.base,
                list(w.fts),
                target,
                device=job.device,
                argv=list(w.argv),
                report_out=w.report_out,
                merge_adapters=w.merge_adapters,
                dtype=w.dtype,
            )
        except (InputError, RuntimeFailure, OSError) as exc:
            exc.by_command = w.argv[1]  # type: ignore[attr-defined]  # its hints are that command's
            raise
        route = doc.get("parameters", {}).get("adapter_route")
        if w.adapter and route != "exact":  # writes_adapter promised the exact route
            raise RuntimeFailure(
                f"internal error: candidate {w.cand.label} was to be written as an exact adapter, "
                f"and {'the ' + route + ' route' if route else 'a full checkpoint'} wrote it"
            )
        info = {"key": job.key, "seconds": round(time.perf_counter() - t0, 3), "bytes": dir_bytes(target)}
        info["snapshot"] = integrity.snapshot(target)  # what the evaluation must leave as it is
        write_json(target.parent / f"{target.name}.key", info)
    t0 = time.perf_counter()
    base_ck = open_checkpoint(w.base, label="BASE")
    fts = []
    try:
        for i, spec in enumerate(w.fts):
            fts.append(open_ft(spec, base=base_ck, label="FT" if i == 0 else f"--merge-ft {spec}"))
        # an adapter is measured as the model it stands for, BASE + ΔW, as FT is
        cand_ck = (
            open_ft(str(target), base=base_ck, label="candidate")
            if w.adapter
            else Checkpoint(target, label="candidate")
        )
        try:
            distance = update_distance(base_ck, fts, cand_ck)
        finally:
            cand_ck.close()
    finally:
        for ck in [base_ck, *fts]:
            ck.close()
    return {**info, "distance": distance, "distance_seconds": round(time.perf_counter() - t0, 3)}


def prepare_failure(job: Job, exc: BaseException, *, remote: bool) -> JobResult:
    """The result of a job whose candidate could not be written (or whose adapter could not be
    merged for its evaluation), the same wherever it ran: bad input for this candidate (its
    strengths overflow the output dtype) fails the candidate, cached; the machine's failure
    (disk full, out of descriptors: a runtime failure) stops the sweep (``fatal``, exit 3)."""
    from dghard_cli.io.files import RESOURCE_ERRNOS

    what = getattr(exc, "message", None) or str(exc)
    command = getattr(exc, "by_command", None)
    if command is not None:  # the hints in ``what`` are options of that command (--exclude ...)
        doing = f"candidate could not be written by its command (dghard {command})"
    elif job.write is not None:
        doing = "candidate could not be written"
    else:
        doing = "model could not be prepared"
    message = f"the {doing}: {what}"
    machine = isinstance(exc, RuntimeFailure) or (isinstance(exc, OSError) and exc.errno in RESOURCE_ERRNOS)
    res = failed_result(
        job,
        message,
        # bad input is this candidate's own; on a remote worker it may be the node's (no shared
        # file system there), so it is tried again on resume
        cacheable=isinstance(exc, InputError) and job.write is not None and not remote,
    )
    if machine:
        res.fatal = message
    return res


def run_job(job: Job, assignment: dict | None = None) -> JobResult:
    """Prepare (unless the sweep did: ``job.prepared``), evaluate and check one job; never
    raises for the job's own failures (they are its record), only for an interruption."""
    assignment = assignment or {}
    work = Path(job.workdir)
    prepared = job.prepared
    remote = bool(assignment.get("remote"))
    if prepared is None:
        try:
            prepared = prepare(job)
        except (InputError, RuntimeFailure, OSError) as exc:
            res = prepare_failure(job, exc, remote=remote)
            if remote:
                res.rec["node"] = socket.gethostname()
            return res
    model = Path(prepared["model"])
    merged = work / MERGED_DIR if "merged_bytes" in prepared else None
    ev = work / EVAL_DIR
    device = (
        str(assignment["device"])
        if assignment.get("device") is not None
        else os.environ.get("CUDA_VISIBLE_DEVICES", "")
    )
    env = dict(job.env)
    if assignment.get("device") is not None:
        env["CUDA_VISIBLE_DEVICES"] = device
    try:
        shutil.rmtree(ev, ignore_errors=True)
        ev.mkdir(parents=True)
        output = ev / "output"
        run = run_command(
            job.template,
            model,
            output,
            ev / "logs",
            timeout=job.timeout,
            label=job.label,
            device=device,
            env=env,
        )
    finally:
        if merged is not None:
            shutil.rmtree(merged, ignore_errors=True)
    rec: dict = {
        "label": job.label,
        "status": run.status,
        "message": run.message,
        "log_tail": run.log_tail,
        "returncode": run.returncode,
        "seconds": {"eval": round(run.seconds, 3)},
        "created": _now(),
    }
    if run.leftovers:
        rec["leftover_processes_ended"] = True
    if "merge_seconds" in prepared:
        rec["seconds"]["merge"] = prepared["merge_seconds"]
        rec["merged_bytes"] = prepared.get("merged_bytes", 0)
    if assignment.get("device") is not None:
        rec["device"] = device
    results = None
    if run.status == "ok":
        try:
            results = str(locate_results(output, run.stdout, uses_output="{output}" in job.template))
        except InputError as exc:
            rec.update(status="unreadable", message=f"unreadable results: {exc}", log_tail=None)
    if job.write is not None:
        tampered = integrity.changed(work / CANDIDATE_DIR, prepared.get("snapshot"))
        if tampered:
            rec["status"], results = "failed", None
            rec["message"] = (
                f"the evaluation command changed the candidate it evaluated ({tampered}); its "
                "results are discarded (evaluate {model} without writing into it)"
            )
    if interrupted() and not _readable_json(results):
        # it exited 0 as the interruption came, but what it wrote is not a results file (a
        # command that answers SIGTERM with exit 0): evaluated again on resume, never cached
        rec.update(status="failed", message="interrupted before it wrote its results", log_tail=None)
        return JobResult(job.key, rec, None, prepared, cacheable=False)
    return JobResult(job.key, rec, results, prepared)


def _readable_json(path: str | None) -> bool:
    """Whether ``path`` is a JSON document (what a finished evaluation leaves)."""
    import json

    if path is None:
        return False
    try:
        with open(path, "rb") as fh:
            json.loads(fh.read())
    except (OSError, ValueError):
        return False
    return True
