"""Plan → execute → write, shared by every command that writes a model.

``write_model`` takes opened inputs, a plan and a per-tensor operation, and does the rest:
output checks, free-space check, the staging directory (resumable), the streaming pipeline,
the index, the fine-tune's side files, the report and model card, verification, and the
final rename. A dry run stops after the plan and reads nothing but headers.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from dghard_cli.engine import input_checks
from dghard_cli.engine.device import resolve_device
from dghard_cli.engine.ops import TensorOp, base_record
from dghard_cli.engine.pipeline import EngineOptions, execute
from dghard_cli.engine.plan import Plan
from dghard_cli.engine.progress import Progress, notice
from dghard_cli.engine.working_memory import check_jobs
from dghard_cli.errors import InputError, Interrupted, RuntimeFailure
from dghard_cli.io.atomic import write_json_atomic
from dghard_cli.io.checkpoint import Checkpoint, path_exists
from dghard_cli.io.output import (
    INDEX_NAME,
    OutputStage,
    check_free_space,
    check_out_path,
    list_side_files,
    read_side_text,
)
from dghard_cli.io.paths import RESERVED_NAMES, Output, check_outputs, check_shard_names
from dghard_cli.io.verify import verify_dir
from dghard_cli.report import build as report_mod
from dghard_cli.report import model_card

REPORT_NAME = "dghard_report.json"


@dataclass
class RunOptions:
    """How to run (not what to compute): device, dry run, resume, output handling."""

    device: str = "auto"
    dry_run: bool = False
    resume: bool | None = None  # None: resume a matching partial output automatically
    overwrite: bool = False
    report_path: Path | None = None
    quiet: bool = True
    argv: list[str] | None = None
    engine: EngineOptions | None = None  # None: EngineOptions.for_device(device)
    allow_nonfinite: bool = False  # NaN/Inf in an input tensor: pass FT's value through, reported
    #: The output path the report names, when OUT is a staging place the caller moves into
    #: place itself (a sweep's candidates); None: OUT.
    report_out: str | None = None
    #: Print warnings about the inputs and the resume line on stderr; None: unless ``quiet``.
    notices: bool | None = None

    @property
    def show_notices(self) -> bool:
        return (not self.quiet) if self.notices is None else self.notices


def fingerprint(command: str, method: str, parameters: dict, plan: Plan, inputs: list[Checkpoint]) -> str:
    """Identity of a run: same command, parameters, plan and input files -> same value."""
    files = []
    for ck in inputs:
        for shard in ck.shards:
            st = (ck.path / shard).stat()
            files.append([str((ck.path / shard).resolve()), st.st_size, st.st_mtime_ns])
    doc = {
        "command": command,
        "method": method,
        "parameters": parameters,
        "plan": [[j.name, j.action, j.out_dtype, j.shard] for j in plan.jobs],
        "files": files,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


#: What a dry run's records leave out of a tensor's record: only the plan is known.
_UNREAD_KEYS = ("input_dtype", "shared_rows", "base_rows")


def plan_records(plan: Plan) -> list[dict]:
    """The records of a dry run: each tensor's record as far as the plan says it."""
    return [{k: v for k, v in base_record(j).items() if k not in _UNREAD_KEYS} for j in plan.jobs]


def inputs_doc(base: Checkpoint, fts: list[Checkpoint]) -> dict:
    if len(fts) == 1:
        return {"base": base.describe(), "ft": fts[0].describe()}
    return {"base": base.describe(), "fts": [f.describe() for f in fts]}


def _report_target(out: Path, report_path: Path | None) -> tuple[str | None, Path | None]:
    """(path relative to OUT, or None; absolute path outside OUT, or None)."""
    if report_path is None:
        return REPORT_NAME, None
    rp = Path(report_path).expanduser().absolute()
    try:
        return str(rp.relative_to(Path(out).expanduser().absolute())), None
    except ValueError:
        return None, rp


def report_target(out: Path, report_path: Path | None) -> tuple[str | None, Path | None]:
    """Where ``--report`` goes: (path relative to OUT, or None; absolute path outside OUT, or
    None); InputError when the directory of a report outside OUT does not exist."""
    rel_report, abs_report = _report_target(out, report_path)
    if abs_report is not None and not path_exists(abs_report.parent):
        raise InputError(f"--report {report_path}: directory {abs_report.parent} does not exist")
    return rel_report, abs_report


def check_report_path(
    out: Path, report_path: Path | None, base: Checkpoint, fts: list[Checkpoint], writes: set[str]
) -> None:
    """The output-path rule for ``--report``: not inside an input, not onto a file OUT gets
    (``writes``: the names the run writes into OUT besides the reserved ones)."""
    if report_path is None:
        return
    check_outputs(
        [
            ("BASE", base.path),
            *[("FT" if len(fts) == 1 else f"FT #{k}", f.path) for k, f in enumerate(fts, 1)],
        ],
        [
            Output(
                "OUT",
                out,
                is_dir=True,
                writes=frozenset((RESERVED_NAMES | writes) - {REPORT_NAME}),
                replaces=True,
            ),
            Output("--report", Path(report_path)),
        ],
    )


def write_model(
    *,
    command: str,
    method: str,
    parameters: dict,
    base: Checkpoint,
    fts: list[Checkpoint],
    out: Path,
    plan: Plan,
    make_op: Callable[[torch.device], TensorOp],
    run: RunOptions,
    spectral: bool = True,
    extra_report: Callable[[list[dict]], dict] | None = None,
    timings: dict | None = None,
) -> dict:
    """Write the model the plan describes to OUT; returns the report document.

    ``timings``: what the caller spent before (plan, calibration), counted in the total.
    ``extra_report``: called with the per-tensor records once the tensors are written; what
    it returns is added to the report, which is then written once, inside the staging
    directory, before the rename.
    """
    t_start = time.perf_counter()
    timings = dict(timings or {})
    before = sum(timings.values())
    device = resolve_device(run.device)
    out = Path(out)
    check_out_path(out, [base.path, *[f.path for f in fts]], overwrite=run.overwrite)
    rel_report, abs_report = report_target(out, run.report_path)
    check_jobs(plan.jobs, method=method, spectral=spectral, device=device)
    where = fts[0].path / (fts[0].index_file or "")
    check_shard_names(plan.shards, f"FT {where}" if fts[0].index_file else f"FT {fts[0].path}")
    # an adapter FT (io.adapter_source) takes BASE's config and tokenizer, then its own tokenizer
    side_sources = getattr(fts[0], "side_file_sources", lambda: [(fts[0].path, set(fts[0].shards))])()
    side = [entry for d, skip in side_sources for entry in list_side_files(d, skip)]
    check_report_path(out, run.report_path, base, fts, set(plan.shards) | {n for n, _ in side})

    input_warnings, swap_ruled_out = input_checks.before_run(base, fts, plan)
    if run.show_notices:
        for w in input_warnings:
            notice(w, warning=True)
    common = dict(
        command=command,
        argv=run.argv,
        inputs=inputs_doc(base, fts),
        method=method,
        parameters=parameters,
        device=report_mod.device_info(device, run.device),
        notes=plan.notes,
        spectral=spectral,
    )
    if run.dry_run:
        timings["total"] = time.perf_counter() - t_start + before
        doc = report_mod.build_report(
            output={"path": str(out), "bytes": plan.out_bytes, "shards": len(plan.shards), "dry_run": True},
            timings=timings,
            memory=report_mod.peak_memory(),
            records=plan_records(plan),
            **common,
        )
        doc["summary"]["dry_run"] = True
        doc["summary"]["warnings"][:0] = input_warnings
        return doc

    check_free_space(out, plan.out_bytes + sum(size for _, size in side))
    fp = fingerprint(command, method, parameters, plan, [base, *fts])
    stage = OutputStage(out, fp, resume=run.resume)
    resumed_tensors = sum(len(plan.shards[s]) for s in stage.done)
    if stage.done and run.show_notices:
        notice(
            f"resuming: {resumed_tensors} of {len(plan.jobs)} tensors already written "
            f"({len(stage.done)} of {len(plan.shards)} shards, verified), continuing"
        )
    progress = Progress(plan.out_bytes, len(plan.jobs), label=f"{command} {method}", quiet=run.quiet)
    if stage.done:
        done_bytes = sum(j.out_nbytes for j in plan.jobs if j.shard in stage.done)
        progress.advance(done_bytes, resumed_tensors)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    try:
        records = execute(
            plan,
            stage,
            make_op(device),
            ft_metadata=fts[0].shard_metadata,
            options=run.engine or EngineOptions.for_device(device, allow_nonfinite=run.allow_nonfinite),
            on_tensor=lambda job, rec: progress.advance(job.out_nbytes),
        )
    except KeyboardInterrupt:
        progress.close()
        stage.lock.release()
        raise Interrupted(
            f"interrupted; finished shards are kept in {stage.dir}",
            hint="run the same command again to resume",
        ) from None
    except InputError:
        progress.close()
        stage.discard()
        raise
    except MemoryError:
        progress.close()
        stage.lock.release()
        raise RuntimeFailure(
            f"out of memory; finished shards are kept in {stage.dir}",
            hint="rerun the same command (smaller blocks: --device cpu frees GPU memory)",
        ) from None
    except torch.cuda.OutOfMemoryError:
        progress.close()
        stage.lock.release()
        raise RuntimeFailure(
            f"CUDA out of memory; finished shards are kept in {stage.dir}",
            hint="rerun the same command, or with --device cpu",
        ) from None
    except OSError as exc:
        progress.close()
        stage.lock.release()
        raise RuntimeFailure(
            f"I/O error ({exc.strerror or exc}); finished shards are kept in {stage.dir}",
            hint="fix the cause (disk full?) and run the same command again to resume",
        ) from None
    progress.close()
    timings["process"] = time.perf_counter() - t0

    t1 = time.perf_counter()
    try:
        if plan.write_index:
            weight_map = {j.name: j.shard for j in plan.jobs}
            stage.write_json(
                INDEX_NAME,
                {"metadata": {"total_size": plan.out_bytes}, "weight_map": dict(sorted(weight_map.items()))},
            )
        copied = sorted({n for d, skip in side_sources for n in stage.copy_side_files(d, skip)})
    except OSError as exc:
        raise _io_failure(exc, stage, "copying the fine-tune's side files") from None
    their_card, card_why = read_side_text(fts[0].path, "README.md")
    expected = {j.name: (j.out_dtype, j.shape) for j in plan.jobs}
    verify_dir(stage.dir, expected=expected)
    timings["verify"] = time.perf_counter() - t1
    timings["total"] = time.perf_counter() - t_start + before

    output = {
        "path": run.report_out if run.report_out is not None else str(out),
        "shards": len(plan.shards),
        "bytes": plan.out_bytes,
        "index": plan.write_index,
        "copied_files": copied,
        "resumed": bool(stage.resumed),
        "resumed_tensors": resumed_tensors,
        "resumed_shards": stage.resumed,
        "files": [{"name": r.name, "size": r.size, "sha256": r.sha256} for r in stage.done.values()],
    }
    if not swap_ruled_out:
        swapped = input_checks.weights_swap(records, len(fts))
        if run.show_notices:
            for w in swapped:
                notice(w, warning=True)
        input_warnings += swapped
    extra = extra_report(records) if extra_report else None
    doc = report_mod.build_report(
        output=output,
        timings=timings,
        memory=report_mod.peak_memory(device),
        records=records,
        extra=extra,
        **common,
    )
    doc["summary"]["warnings"][:0] = input_warnings
    card, doc["output"]["model_card"] = model_card.compose(
        report_mod.model_card(doc), their_card, base.source, card_why
    )
    try:
        if rel_report is not None:
            target = stage.dir / rel_report
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        stage.write_text("README.md", card)
    except OSError as exc:
        raise _io_failure(exc, stage, "writing the report and model card") from None
    try:
        stage.finalize(overwrite=run.overwrite)
    except OSError as exc:
        stage.lock.release()
        raise RuntimeFailure(f"could not move {stage.dir} to {out}: {exc.strerror or exc}") from None
    write_report_outside(out, abs_report, doc)
    return doc


def write_report_outside(out: Path, abs_report: Path | None, doc: dict) -> None:
    """``--report`` outside OUT, written once OUT is complete (exit 3 if that write fails)."""
    if abs_report is None:
        return
    try:
        write_json_atomic(abs_report, doc)
    except OSError as exc:
        raise RuntimeFailure(
            f"{out} is complete, but writing --report {abs_report} failed ({exc.strerror or exc})"
        ) from None


def _io_failure(exc: OSError, stage: OutputStage, doing: str) -> RuntimeFailure:
    """Disk full, permission denied … after the shards were written: exit 3, resumable."""
    stage.lock.release()
    return RuntimeFailure(
        f"I/O error while {doing} ({exc.strerror or exc}); finished shards are kept in {stage.dir}",
        hint="fix the cause (disk full?) and run the same command again to resume",
    )
