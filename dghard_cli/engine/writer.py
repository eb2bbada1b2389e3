"""The one writer of every model a command writes: a full checkpoint or a PEFT adapter.

A command describes its run once (:class:`WriteRequest`: inputs, OUT, plan, per-tensor operation,
parameters) and hands it to :func:`write_output` with an :class:`OutputKind`, the part that
differs between a checkpoint (:class:`~dghard_cli.engine.runner.CheckpointKind`) and an adapter
(:meth:`dghard_cli.lora.output.AdapterOutput.kind`). Everything else is here, done once in this
order:

1. OUT's path rule (not an input, not inside one, empty or ``--overwrite``) and where
   ``--report`` goes (:class:`OutputTarget`; a command that calibrates checks it before its
   forward passes and hands it over, so it is not checked twice);
2. the kind's own checks before anything is read (:meth:`OutputKind.prepare`), then the
   output-path rule for ``--report`` against the files the kind writes, then the warnings about
   the inputs (:meth:`OutputKind.announce`);
3. the fields every report shares (:func:`common_fields`);
4. a dry run's report (:func:`dry_run_report`): the plan, nothing read but headers;
5. the staging directory, keyed by the run's :func:`fingerprint` (resumable), and the kind's
   writing under one exception → exit-code table (:func:`failures`; torch's allocation
   failures on every device included);
6. a ``--report`` outside OUT, once OUT is complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from dghard_cli.engine.device import resolve_device
from dghard_cli.engine.memory_budget import is_out_of_memory, out_of_memory_message
from dghard_cli.engine.ops import TensorOp, base_record
from dghard_cli.engine.pipeline import EngineOptions
from dghard_cli.engine.plan import Plan
from dghard_cli.errors import InputError, Interrupted, RuntimeFailure
from dghard_cli.io.atomic import write_json_atomic
from dghard_cli.io.checkpoint import Checkpoint, path_exists
from dghard_cli.io.output import OutputStage, check_out_path
from dghard_cli.io.paths import RESERVED_NAMES, Output, check_outputs
from dghard_cli.report import build as report_mod

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


@dataclass(frozen=True)
class OutputTarget:
    """OUT, checked against the inputs, and where the report goes: ``rel_report`` (a path inside
    OUT, or None) or ``abs_report`` (a path outside OUT, or None)."""

    out: Path
    report_path: Path | None
    rel_report: str | None
    abs_report: Path | None

    @classmethod
    def check(cls, out: Path, run: RunOptions, base: Checkpoint, fts: list[Checkpoint]) -> OutputTarget:
        """OUT's path rule, and ``--report``'s directory exists when it lies outside OUT."""
        out = Path(out)
        check_out_path(out, [base.path, *[f.path for f in fts]], overwrite=run.overwrite)
        rel_report, abs_report = report_target(out, run.report_path)
        return cls(out, run.report_path, rel_report, abs_report)

    def check_report(self, base: Checkpoint, fts: list[Checkpoint], writes: set[str]) -> None:
        """The output-path rule for ``--report``: not inside an input, not onto a file OUT gets
        (``writes``: the names the run writes into OUT besides the reserved ones)."""
        if self.report_path is None:
            return
        check_outputs(
            [
                ("BASE", base.path),
                *[("FT" if len(fts) == 1 else f"FT #{k}", f.path) for k, f in enumerate(fts, 1)],
            ],
            [
                Output(
                    "OUT",
                    self.out,
                    is_dir=True,
                    writes=frozenset((RESERVED_NAMES | writes) - {REPORT_NAME}),
                    replaces=True,
                ),
                Output("--report", Path(self.report_path)),
            ],
        )

    def write_outside(self, doc: dict) -> None:
        """``--report`` outside OUT, written once OUT is complete (exit 3 if that write fails)."""
        if self.abs_report is None:
            return
        try:
            write_json_atomic(self.abs_report, doc)
        except OSError as exc:
            raise RuntimeFailure(
                f"{self.out} is complete, but writing --report {self.abs_report} failed ({exc.strerror or exc})"
            ) from None


def report_target(out: Path, report_path: Path | None) -> tuple[str | None, Path | None]:
    """Where ``--report`` goes: (path relative to OUT, or None; absolute path outside OUT, or
    None); InputError when the directory of a report outside OUT does not exist."""
    if report_path is None:
        return REPORT_NAME, None
    rp = Path(report_path).expanduser().absolute()
    try:
        return str(rp.relative_to(Path(out).expanduser().absolute())), None
    except ValueError:
        pass
    if not path_exists(rp.parent):
        raise InputError(f"--report {report_path}: directory {rp.parent} does not exist")
    return None, rp


@dataclass
class WriteRequest:
    """One run to write, as a command describes it, whatever the output's kind.

    ``make_op``: the per-tensor operation on a device. ``timings``: what the command spent
    before (plan, calibration). ``extra_report``: called with the per-tensor records once the
    tensors are written; what it returns is added to a checkpoint's report (an adapter's report
    has its own ``adapter`` section). ``strengths``: a bound layer-strength schedule
    (``dghard_cli/schedule/``), or None. ``target``: OUT already checked (a command that
    calibrates checks it before its forward passes)."""

    command: str
    method: str
    parameters: dict
    base: Checkpoint
    fts: list[Checkpoint]
    out: Path
    plan: Plan
    make_op: Callable[[torch.device], TensorOp]
    run: RunOptions
    spectral: bool = True
    extra_report: Callable[[list[dict]], dict] | None = None
    timings: dict = field(default_factory=dict)
    strengths: object | None = None
    target: OutputTarget | None = None


class OutputKind(Protocol):
    """What differs between writing a checkpoint and writing an adapter (one object per run)."""

    #: what one resumable piece of the stage is called in messages ("shards", "modules")
    unit: str

    def prepare(self, req: WriteRequest, device: torch.device) -> set[str]:
        """The kind's checks before anything is read; the names it writes into OUT."""
        ...

    def announce(self, req: WriteRequest) -> None:
        """Once every check has passed: the warnings about the inputs (printed unless quiet)."""
        ...

    def discard_on_bad_input(self) -> bool:
        """Whether bad input found while writing discards the stage (else its units are kept)."""
        ...

    def parameters(self, req: WriteRequest) -> dict:
        """The report's parameters: the command's and what the kind adds."""
        ...

    def spectral(self, req: WriteRequest) -> bool:
        """Whether the report describes spectra (a spectral method computed on full tensors)."""
        ...

    def dry_run(self, req: WriteRequest, common: dict) -> dict:
        """A dry run's report (:func:`dry_run_report` with the kind's ``output`` section)."""
        ...

    def open_stage(self, req: WriteRequest, fp: str) -> OutputStage:
        """The staging directory, resumed when an interrupted run of fingerprint ``fp`` left it."""
        ...

    def write(self, req: WriteRequest, target: OutputTarget, common: dict, device: torch.device) -> dict:
        """Compute and write into the stage, then move it to OUT; the report document."""
        ...


def common_fields(req: WriteRequest, parameters: dict, spectral: bool, device: torch.device) -> dict:
    """The fields every report of a written model shares."""
    return dict(
        command=req.command,
        argv=req.run.argv,
        inputs=inputs_doc(req.base, req.fts),
        method=req.method,
        parameters=parameters,
        device=report_mod.device_info(device, req.run.device),
        notes=list(req.plan.notes),
        spectral=spectral,
    )


def dry_run_report(req: WriteRequest, output: dict, common: dict, timings: dict) -> dict:
    """A dry run's report: the plan only, nothing read but headers, nothing written. ``output``:
    the kind's ``output`` section."""
    doc = report_mod.build_report(
        output=output,
        timings=timings,
        memory=report_mod.peak_memory(),
        records=plan_records(req.plan),
        **common,
    )
    doc["summary"]["dry_run"] = True
    if req.strengths is not None:  # the plan's λ of each layer
        doc["layer_strengths"] = req.strengths.report()  # type: ignore[attr-defined]
    return doc


@contextlib.contextmanager
def failures(
    stage: OutputStage, unit: str, doing: str | None = None, discard: Callable[[], bool] | None = None
) -> Iterator[None]:
    """The one exception → exit-code table of a run writing into ``stage``.

    Interrupted (Ctrl-C), out of memory (MemoryError, torch's OutOfMemoryError and its CPU
    allocator's RuntimeError) and I/O errors keep the finished
    ``unit`` (exit 3, resumable). Bad input found while computing discards the stage (exit 2),
    unless ``discard()`` says the finished units are worth keeping (a checkpoint whose tensors
    are all written). Whatever ends the run, OUT's lock is released."""
    kept = f"finished {unit} are kept in {stage.dir}"
    try:
        yield
    except KeyboardInterrupt:
        stage.lock.release()
        raise Interrupted(f"interrupted; {kept}", hint="run the same command again to resume") from None
    except InputError:
        if discard is None or discard():
            stage.discard()
        else:
            stage.lock.release()
        raise
    except torch.cuda.OutOfMemoryError:
        stage.lock.release()
        raise RuntimeFailure(
            f"CUDA out of memory; {kept}", hint="rerun the same command, or with --device cpu"
        ) from None
    except (MemoryError, RuntimeError) as exc:  # torch's CPU allocator raises RuntimeError
        stage.lock.release()
        if not is_out_of_memory(exc):
            raise
        raise RuntimeFailure(
            f"{out_of_memory_message(exc)}; {kept}",
            hint="free memory and run the same command again to resume",
        ) from None
    except OSError as exc:
        stage.lock.release()
        what = f"I/O error while {doing}" if doing else "I/O error"
        raise RuntimeFailure(
            f"{what} ({exc.strerror or exc}); {kept}",
            hint="fix the cause (disk full?) and run the same command again to resume",
        ) from None
    except BaseException:  # anything else (an internal error): the lock still goes
        stage.lock.release()
        raise


def write_output(req: WriteRequest, kind: OutputKind) -> dict:
    """Write the run ``req`` describes into OUT as ``kind``; returns the report document (with
    ``req.run.dry_run``: the plan's report, nothing written)."""
    device = resolve_device(req.run.device)
    target = req.target or OutputTarget.check(req.out, req.run, req.base, req.fts)
    writes = kind.prepare(req, device)
    target.check_report(req.base, req.fts, writes)
    kind.announce(req)
    common = common_fields(req, kind.parameters(req), kind.spectral(req), device)
    if req.run.dry_run:
        return kind.dry_run(req, common)
    fp = fingerprint(req.command, req.method, common["parameters"], req.plan, [req.base, *req.fts])
    stage = kind.open_stage(req, fp)
    with failures(stage, kind.unit, discard=kind.discard_on_bad_input):
        doc = kind.write(req, target, common, device)
    target.write_outside(doc)
    return doc
