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
from dghard_cli.engine.pipeline import EngineOptions, StageClock, execute
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
    split_side_files,
)
from dghard_cli.io.paths import RESERVED_NAMES, Output, check_outputs, check_shard_names
from dghard_cli.io.report_json import json_text
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
    w = _ModelWrite(command, method, parameters, base, fts, Path(out), plan, run, spectral, timings)
    w.check_outputs()
    w.warn_about_inputs()
    if run.dry_run:
        return w.dry_run_report()
    w.open_stage()
    records = w.stream(make_op)
    copied, card_source = w.write_side_files()
    doc, card = w.report(records, copied, card_source, extra_report)
    w.commit(doc, card)
    return doc


class _ModelWrite:
    """The steps of :func:`write_model`, in order; each check and each write is done once."""

    def __init__(
        self,
        command: str,
        method: str,
        parameters: dict,
        base: Checkpoint,
        fts: list[Checkpoint],
        out: Path,
        plan: Plan,
        run: RunOptions,
        spectral: bool,
        timings: dict | None,
    ) -> None:
        self.t_start = time.perf_counter()
        self.timings = dict(timings or {})
        self.before = sum(self.timings.values())
        self.stages: dict[str, float] = {}  # where the streaming time went (StageClock.report)
        self.command = command
        self.method = method
        self.parameters = parameters
        self.base = base
        self.fts = fts
        self.out = out
        self.plan = plan
        self.run = run
        self.spectral = spectral
        self.device = resolve_device(run.device)

    def _total(self) -> float:
        return time.perf_counter() - self.t_start + self.before

    def check_outputs(self) -> None:
        """Before anything is read: the output-path rule for OUT, where ``--report`` goes (its
        directory exists), the working memory of every job, the shard names, and the
        output-path rule for ``--report`` (not onto an input, not onto a file OUT gets)."""
        base, fts, plan, run = self.base, self.fts, self.plan, self.run
        check_out_path(self.out, [base.path, *[f.path for f in fts]], overwrite=run.overwrite)
        self.rel_report, self.abs_report = report_target(self.out, run.report_path)
        check_jobs(plan.jobs, method=self.method, spectral=self.spectral, device=self.device)
        where = fts[0].path / (fts[0].index_file or "")
        check_shard_names(plan.shards, f"FT {where}" if fts[0].index_file else f"FT {fts[0].path}")
        # an adapter FT (lora.source) takes BASE's config and tokenizer, then its own tokenizer
        ft = fts[0]
        sources = getattr(ft, "side_file_sources", lambda: [(ft.path, set(ft.shards))])()
        # a merge of several fine-tunes is not FT #1: FT #1's training notes and card stay behind
        self.side_sources, self.side_left_out = split_side_files(sources, several=len(fts) > 1)
        self.side = [entry for d, skip in self.side_sources for entry in list_side_files(d, skip)]
        check_report_path(self.out, run.report_path, base, fts, set(plan.shards) | {n for n, _ in self.side})

    def warn_about_inputs(self) -> None:
        """The inputs' warnings (printed unless quiet) and what every report shares."""
        self.input_warnings, self.swap_ruled_out = input_checks.before_run(self.base, self.fts, self.plan)
        if self.run.show_notices:
            for w in self.input_warnings:
                notice(w, warning=True)
        self.common = dict(
            command=self.command,
            argv=self.run.argv,
            inputs=inputs_doc(self.base, self.fts),
            method=self.method,
            parameters=self.parameters,
            device=report_mod.device_info(self.device, self.run.device),
            notes=self.plan.notes,
            spectral=self.spectral,
        )

    def dry_run_report(self) -> dict:
        """The report of a dry run: the plan only, nothing read but headers, nothing written."""
        plan = self.plan
        self.timings["total"] = self._total()
        doc = report_mod.build_report(
            output={
                "path": str(self.out),
                "bytes": plan.out_bytes,
                "shards": len(plan.shards),
                "dry_run": True,
            },
            timings=self.timings,
            memory=report_mod.peak_memory(),
            records=plan_records(plan),
            **self.common,
        )
        doc["summary"]["dry_run"] = True
        doc["summary"]["warnings"][:0] = self.input_warnings
        return doc

    def open_stage(self) -> None:
        """Free space, then the staging directory (resumed when it matches this run) and the
        progress counter, advanced past the shards already written."""
        plan, run = self.plan, self.run
        check_free_space(self.out, plan.out_bytes + sum(size for _, size in self.side))
        fp = fingerprint(self.command, self.method, self.parameters, plan, [self.base, *self.fts])
        self.stage = stage = OutputStage(self.out, fp, resume=run.resume)
        self.resumed_tensors = sum(len(plan.shards[s]) for s in stage.done)
        if stage.done and run.show_notices:
            notice(
                f"resuming: {self.resumed_tensors} of {len(plan.jobs)} tensors already written "
                f"({len(stage.done)} of {len(plan.shards)} shards, verified), continuing"
            )
        self.progress = Progress(
            plan.out_bytes, len(plan.jobs), label=f"{self.command} {self.method}", quiet=run.quiet
        )
        if stage.done:
            done_bytes = sum(j.out_nbytes for j in plan.jobs if j.shard in stage.done)
            self.progress.advance(done_bytes, self.resumed_tensors)

    def stream(self, make_op: Callable[[torch.device], TensorOp]) -> list[dict]:
        """Every tensor through the pipeline into the stage; the per-tensor records. A failure
        keeps the finished shards (exit 3, resumable), except bad input (the stage discarded)."""
        device, stage, progress = self.device, self.stage, self.progress
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        clock = StageClock()
        try:
            records = execute(
                self.plan,
                stage,
                make_op(device),
                ft_metadata=self.fts[0].shard_metadata,
                options=self.run.engine
                or EngineOptions.for_device(device, allow_nonfinite=self.run.allow_nonfinite),
                on_tensor=lambda job, rec: progress.advance(job.out_nbytes),
                clock=clock,
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
        self.timings["process"] = time.perf_counter() - t0
        self.stages = clock.report()
        return records

    def write_side_files(self) -> tuple[list[str], tuple[str | None, str | None]]:
        """The index and the fine-tune's side files into the stage, then the stage verified;
        (the side files copied, the fine-tune's own model card and why it is not used)."""
        plan, stage = self.plan, self.stage
        t1 = time.perf_counter()
        try:
            if plan.write_index:
                weight_map = {j.name: j.shard for j in plan.jobs}
                stage.write_json(
                    INDEX_NAME,
                    {
                        "metadata": {"total_size": plan.out_bytes},
                        "weight_map": dict(sorted(weight_map.items())),
                    },
                )
            self.side_from: dict[str, Path] = {}
            for d, skip in self.side_sources:
                for n in stage.copy_side_files(d, skip):
                    self.side_from[n] = Path(d)  # a later source's file replaces an earlier one's
            copied = sorted(self.side_from)
        except OSError as exc:
            raise _io_failure(exc, stage, "copying the fine-tune's side files") from None
        if len(self.fts) > 1:
            card_source = (
                None,
                "not used: it describes FT #1 alone, and this is a merge of several fine-tunes",
            )
        else:
            card_source = read_side_text(self.fts[0].path, "README.md")
        expected = {j.name: (j.out_dtype, j.shape) for j in plan.jobs}
        verify_dir(stage.dir, expected=expected)
        self.timings["verify"] = time.perf_counter() - t1
        self.timings["total"] = self._total()
        return copied, card_source

    def _input_label(self, d: Path) -> str:
        """``FT #1 (`source`)``, ``FT (`source`)`` or ``BASE (`source`)`` for a side files' directory."""
        for i, f in enumerate(self.fts, 1):
            if Path(f.path) == d:
                return f"FT{f' #{i}' if len(self.fts) > 1 else ''} (`{f.source}`)"
        if Path(self.base.path) == d:
            return f"BASE (`{self.base.source}`)"
        return f"`{d}`"

    def side_file_summary(self, copied: list[str]) -> list[dict]:
        """Where each side file came from, and those left out (a merge of several fine-tunes)."""
        by_dir: dict[Path, list[str]] = {}
        for n in copied:
            by_dir.setdefault(self.side_from[n], []).append(n)
        out = [{"from": self._input_label(d), "copied": names} for d, names in by_dir.items()]
        left: dict[Path, list[str]] = {}
        for n, d in self.side_left_out:
            left.setdefault(d, []).append(n)
        out += [
            {"from": self._input_label(d), "left_out": sorted(names), "why": "they describe that model alone"}
            for d, names in left.items()
        ]
        return out

    def report(
        self,
        records: list[dict],
        copied: list[str],
        card_source: tuple[str | None, str | None],
        extra_report: Callable[[list[dict]], dict] | None,
    ) -> tuple[dict, str]:
        """The report document (with the weight-swap warnings now the records are known) and
        the model card."""
        plan, stage, run = self.plan, self.stage, self.run
        output = {
            "path": run.report_out if run.report_out is not None else str(self.out),
            "shards": len(plan.shards),
            "bytes": plan.out_bytes,
            "index": plan.write_index,
            "copied_files": copied,
            "side_files": self.side_file_summary(copied),
            "resumed": bool(stage.resumed),
            "resumed_tensors": self.resumed_tensors,
            "resumed_shards": stage.resumed,
            "files": [{"name": r.name, "size": r.size, "sha256": r.sha256} for r in stage.done.values()],
        }
        if not self.swap_ruled_out:
            swapped = input_checks.weights_swap(records, len(self.fts))
            if run.show_notices:
                for w in swapped:
                    notice(w, warning=True)
            self.input_warnings += swapped
        extra = extra_report(records) if extra_report else None
        doc = report_mod.build_report(
            output=output,
            timings=self.timings,
            memory=report_mod.peak_memory(self.device),
            records=records,
            extra=extra,
            **self.common,
        )
        doc["summary"]["warnings"][:0] = self.input_warnings
        if self.stages:
            doc["timings"]["stages"] = self.stages
        their_card, card_why = card_source
        card, doc["output"]["model_card"] = model_card.compose(
            report_mod.model_card(doc), their_card, self.base.source, card_why
        )
        return doc, card

    def commit(self, doc: dict, card: str) -> None:
        """The report (when inside OUT) and the model card into the stage, the stage moved to
        OUT, then a ``--report`` outside OUT."""
        stage = self.stage
        try:
            if self.rel_report is not None:  # every write into the stage maps its OSError in one place
                stage.write_text(str(self.rel_report), json_text(doc))
            stage.write_text("README.md", card)
        except OSError as exc:
            raise _io_failure(exc, stage, "writing the report and model card") from None
        try:
            stage.finalize(overwrite=self.run.overwrite)
        except OSError as exc:
            stage.lock.release()
            raise RuntimeFailure(f"could not move {stage.dir} to {self.out}: {exc.strerror or exc}") from None
        write_report_outside(self.out, self.abs_report, doc)


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
