"""A full checkpoint as the output of a run: the checkpoint kind of the one writer.

:class:`CheckpointKind` is what :func:`~dghard_cli.engine.writer.write_output` runs for a full
checkpoint: the plan's checks (working memory, shard names, the fine-tune's side files), the
free-space check, the streaming pipeline into the staging directory (resumable), the index, the
fine-tune's side files, the report and model card, verification, and the final rename. A dry
run stops after the plan and reads nothing but headers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from dghard_cli.engine import input_checks
from dghard_cli.engine.ops import TensorOp
from dghard_cli.engine.pipeline import EngineOptions, StageClock, execute
from dghard_cli.engine.progress import Progress, notice
from dghard_cli.engine.working_memory import check_jobs
from dghard_cli.engine.writer import (
    OutputTarget,
    WriteRequest,
    dry_run_report,
    failures,
)
from dghard_cli.errors import RuntimeFailure
from dghard_cli.io.output import (
    INDEX_NAME,
    OutputStage,
    check_free_space,
    list_side_files,
    read_side_text,
    split_side_files,
)
from dghard_cli.io.paths import check_shard_names
from dghard_cli.io.report_json import json_text
from dghard_cli.io.verify import verify_dir
from dghard_cli.report import build as report_mod
from dghard_cli.report import model_card


class CheckpointKind:
    """The steps of writing a full checkpoint, in order; each check and each write is done once.
    ``added``: what the output decision adds to the report's parameters (a merge of adapters)."""

    unit = "shards"

    def __init__(self, added: dict | None = None) -> None:
        self.t_start = time.perf_counter()
        self.added = dict(added or {})
        self.stages: dict[str, float] = {}  # where the streaming time went (StageClock.report)
        self.streamed = False  # every tensor is in the stage
        # set by prepare()
        self.req: WriteRequest | None = None
        self.device: torch.device | None = None
        self.timings: dict = {}
        self.before = 0.0  # what the command spent before the writer (counted in the total)
        self.side_sources: list = []  # (directory, names to skip) of the side files to copy
        self.side_left_out: list = []  # (name, directory) of those a merge leaves behind
        self.side: list = []  # (name, size) of every side file to copy
        self.input_warnings: list[str] = []
        self.swap_ruled_out = False
        # set by open_stage() and write_side_files()
        self.stage: OutputStage | None = None
        self.resumed_tensors = 0
        self.progress: Progress | None = None
        self.side_from: dict[str, Path] = {}  # side file -> the directory it was copied from

    def _total(self) -> float:
        return time.perf_counter() - self.t_start + self.before

    def parameters(self, req: WriteRequest) -> dict:
        return {**req.parameters, **self.added}

    def spectral(self, req: WriteRequest) -> bool:
        return req.spectral

    def prepare(self, req: WriteRequest, device: torch.device) -> set[str]:
        """Before anything is read: the working memory of every job, the shard names, the side
        files to copy, the inputs' warnings (printed by :meth:`announce`). The names OUT gets."""
        self.req, self.device = req, device
        self.timings = dict(req.timings)
        self.before = sum(self.timings.values())
        fts, plan = req.fts, req.plan
        check_jobs(plan.jobs, method=req.method, spectral=req.spectral, device=device)
        where = fts[0].path / (fts[0].index_file or "")
        check_shard_names(plan.shards, f"FT {where}" if fts[0].index_file else f"FT {fts[0].path}")
        # an adapter FT (lora.source) takes BASE's config and tokenizer, then its own tokenizer
        ft = fts[0]
        sources = getattr(ft, "side_file_sources", lambda: [(ft.path, set(ft.shards))])()
        # a merge of several fine-tunes is not FT #1: FT #1's training notes and card stay behind
        self.side_sources, self.side_left_out = split_side_files(sources, several=len(fts) > 1)
        self.side = [entry for d, skip in self.side_sources for entry in list_side_files(d, skip)]
        self.input_warnings, self.swap_ruled_out = input_checks.before_run(req.base, fts, plan)
        return set(plan.shards) | {n for n, _ in self.side}

    def announce(self, req: WriteRequest) -> None:
        if req.run.show_notices:
            for w in self.input_warnings:
                notice(w, warning=True)

    def discard_on_bad_input(self) -> bool:
        """Bad input found while streaming discards the stage; once every tensor is written
        (side files, verification) the shards are kept for the rerun."""
        return not self.streamed

    def dry_run(self, req: WriteRequest, common: dict) -> dict:
        """The report of a dry run: the plan only, nothing read but headers, nothing written."""
        plan = req.plan
        self.timings["total"] = self._total()
        output = {"path": str(req.out), "bytes": plan.out_bytes, "shards": len(plan.shards), "dry_run": True}
        doc = dry_run_report(req, output, common, self.timings)
        doc["summary"]["warnings"][:0] = self.input_warnings
        return doc

    def open_stage(self, req: WriteRequest, fp: str) -> OutputStage:
        """Free space, then the staging directory (resumed when it matches this run) and the
        progress counter, advanced past the shards already written."""
        plan, run = req.plan, req.run
        check_free_space(req.out, plan.out_bytes + sum(size for _, size in self.side))
        self.stage = stage = OutputStage(req.out, fp, resume=run.resume)
        self.resumed_tensors = sum(len(plan.shards[s]) for s in stage.done)
        if stage.done and run.show_notices:
            notice(
                f"resuming: {self.resumed_tensors} of {len(plan.jobs)} tensors already written "
                f"({len(stage.done)} of {len(plan.shards)} shards, verified), continuing"
            )
        self.progress = Progress(
            plan.out_bytes, len(plan.jobs), label=f"{req.command} {req.method}", quiet=run.quiet
        )
        if stage.done:
            done_bytes = sum(j.out_nbytes for j in plan.jobs if j.shard in stage.done)
            self.progress.advance(done_bytes, self.resumed_tensors)
        return stage

    def write(self, req: WriteRequest, target: OutputTarget, common: dict, device: torch.device) -> dict:
        """Stream, then the side files, the report and the model card; the stage moved to OUT."""
        records = self.stream(req.make_op)
        copied, card_source = self.write_side_files()
        doc, card = self.report(records, copied, card_source, common)
        self.commit(target, doc, card)
        return doc

    def stream(self, make_op: Callable[[torch.device], TensorOp]) -> list[dict]:
        """Every tensor through the pipeline into the stage; the per-tensor records. A failure
        keeps the finished shards (exit 3, resumable), except bad input (the stage discarded)."""
        device, stage, progress, run = self.device, self.stage, self.progress, self.req.run
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        clock = StageClock()
        try:
            records = execute(
                self.req.plan,
                stage,
                make_op(device),
                ft_metadata=self.req.fts[0].shard_metadata,
                options=run.engine or EngineOptions.for_device(device, allow_nonfinite=run.allow_nonfinite),
                on_tensor=lambda job, rec: progress.advance(job.out_nbytes),
                clock=clock,
            )
        finally:
            progress.close()
        self.streamed = True
        self.timings["process"] = time.perf_counter() - t0
        self.stages = clock.report()
        return records

    def write_side_files(self) -> tuple[list[str], tuple[str | None, str | None]]:
        """The index and the fine-tune's side files into the stage, then the stage verified;
        (the side files copied, the fine-tune's own model card and why it is not used)."""
        plan, stage, fts = self.req.plan, self.stage, self.req.fts
        t1 = time.perf_counter()
        with failures(stage, self.unit, "copying the fine-tune's side files", discard=lambda: False):
            if plan.write_index:
                weight_map = {j.name: j.shard for j in plan.jobs}
                stage.write_json(
                    INDEX_NAME,
                    {
                        "metadata": {"total_size": plan.out_bytes},
                        "weight_map": dict(sorted(weight_map.items())),
                    },
                )
            self.side_from = {}
            for d, skip in self.side_sources:
                for n in stage.copy_side_files(d, skip):
                    self.side_from[n] = Path(d)  # a later source's file replaces an earlier one's
            copied = sorted(self.side_from)
        if len(fts) > 1:
            card_source = (
                None,
                "not used: it describes FT #1 alone, and this is a merge of several fine-tunes",
            )
        else:
            card_source = read_side_text(fts[0].path, "README.md")
        expected = {j.name: (j.out_dtype, j.shape) for j in plan.jobs}
        verify_dir(stage.dir, expected=expected)
        self.timings["verify"] = time.perf_counter() - t1
        self.timings["total"] = self._total()
        return copied, card_source

    def _input_label(self, d: Path) -> str:
        """``FT #1 (`source`)``, ``FT (`source`)`` or ``BASE (`source`)`` for a side files' directory."""
        fts, base = self.req.fts, self.req.base
        for i, f in enumerate(fts, 1):
            if Path(f.path) == d:
                return f"FT{f' #{i}' if len(fts) > 1 else ''} (`{f.source}`)"
        if Path(base.path) == d:
            return f"BASE (`{base.source}`)"
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
        common: dict,
    ) -> tuple[dict, str]:
        """The report document (with the weight-swap warnings now the records are known) and
        the model card."""
        req, stage = self.req, self.stage
        plan, run = req.plan, req.run
        output = {
            "path": run.report_out if run.report_out is not None else str(req.out),
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
            swapped = input_checks.weights_swap(records, len(req.fts))
            if run.show_notices:
                for w in swapped:
                    notice(w, warning=True)
            self.input_warnings += swapped
        extra = req.extra_report(records) if req.extra_report else None
        doc = report_mod.build_report(
            output=output,
            timings=self.timings,
            memory=report_mod.peak_memory(self.device),
            records=records,
            extra=extra,
            **common,
        )
        doc["summary"]["warnings"][:0] = self.input_warnings
        if self.stages:
            doc["timings"]["stages"] = self.stages
        their_card, card_why = card_source
        card, doc["output"]["model_card"] = model_card.compose(
            report_mod.model_card(doc), their_card, req.base.source, card_why
        )
        return doc, card

    def commit(self, target: OutputTarget, doc: dict, card: str) -> None:
        """The report (when inside OUT) and the model card into the stage, then the stage moved
        to OUT (the writer then writes a ``--report`` outside OUT)."""
        stage = self.stage
        with failures(stage, self.unit, "writing the report and model card", discard=lambda: False):
            if target.rel_report is not None:
                stage.write_text(str(target.rel_report), json_text(doc))
            stage.write_text("README.md", card)
        try:
            stage.finalize(overwrite=self.req.run.overwrite)
        except OSError as exc:
            stage.lock.release()
            raise RuntimeFailure(
                f"could not move {stage.dir} to {self.req.out}: {exc.strerror or exc}"
            ) from None
