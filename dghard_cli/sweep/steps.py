"""The steps of a sweep that evaluate: the references (BASE, FT), and each candidate written,
measured, evaluated, scored and kept or dropped.

LoRA adapters as fine-tunes: each candidate is written in the format its reproduction command
writes (an adapter where it is exact as one, else the merged checkpoint:
:func:`~dghard_cli.sweep.family_dispatch.writes_adapter`). Whatever the format, it is measured
and evaluated as the model it stands for: its distance to the fine-tune compares BASE + ΔW
(the adapter read as the fine-tune is, :func:`~dghard_cli.lora.source.open_ft`), and the
evaluation command gets that model as a full checkpoint, as it got FT."""

from __future__ import annotations

import datetime as _dt
import math
import os
import shutil
import time
from pathlib import Path

from dghard_cli._version import __version__
from dghard_cli.engine.runner import RunOptions
from dghard_cli.errors import InputError, RuntimeFailure
from dghard_cli.io.checkpoint import Checkpoint
from dghard_cli.io.files import read_json, realpath
from dghard_cli.lora.output import LoraOutputOptions
from dghard_cli.lora.source import is_adapter, open_ft
from dghard_cli.merge import MergeOptions, merge
from dghard_cli.score.results import ResultFile, read_results
from dghard_cli.sweep import integrity
from dghard_cli.sweep.cache import digest, dir_bytes, input_identity, write_json
from dghard_cli.sweep.candidates import Candidate, reproduced_out, shell_command
from dghard_cli.sweep.choose import choose_winner, update_distance
from dghard_cli.sweep.evaluate import locate_results, run_command
from dghard_cli.sweep.family_dispatch import reproduce_argv, write_candidate, writes_adapter


class EvaluationSteps:
    """Evaluating references and candidates (a part of ``run._Sweep``; the attributes it uses are set up there)."""

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
        key = digest(
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
            before = input_identity(ck)
            model = self.merged_adapter(ck.source) if is_adapter(ck) else ck.path.resolve()
            rec, results = self.run_eval(model, what, fixed)
            if is_adapter(ck):
                shutil.rmtree(model, ignore_errors=True)
            if input_identity(ck) != before:
                raise InputError(
                    f"the evaluation command modified {what} ({ck.path}) while evaluating it; "
                    "evaluate {model} without writing into it"
                )
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

    def merged_adapter(self, source: str) -> Path:
        """A LoRA adapter of BASE (a fine-tune, or a candidate written as one) as the full
        checkpoint the evaluation can load (BASE + ΔW)."""
        target = self.stage / "adapter-merged"
        shutil.rmtree(target, ignore_errors=True)
        opts = MergeOptions(
            method="task-arithmetic",
            lora=LoraOutputOptions(merge=True),
            run=RunOptions(device=self.opts.device, quiet=True),
        )
        merge(self.base_spec, [source], target, opts)
        return target.resolve()

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
                rf = read_results(
                    path, metric=self.rule, fixed=fixed, label=f"results of {label}", roots=(realpath(ev),)
                )
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
        what = {"candidate": [cand.command, list(cand.params)], "device": self.opts.device, **self.identity}
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
        )

    def write(self, cand: Candidate, key: str, target: Path) -> dict:
        shutil.rmtree(target, ignore_errors=True)
        t0 = time.perf_counter()
        # the candidate's report names OUT, where the winner ends up: written once, never patched
        adapter = self.as_adapter(cand)
        doc = write_candidate(
            cand,
            self.base_spec,
            self.ft_specs,
            target,
            device=self.opts.device,
            argv=self.reproduce(cand),
            report_out=self.out_arg,
            merge_adapters=self.adapters and not adapter,
        )
        route = doc.get("parameters", {}).get("adapter_route")
        if adapter and route != "exact":  # writes_adapter promised the exact route
            raise RuntimeFailure(
                f"internal error: candidate {cand.label} was to be written as an exact adapter, "
                f"and {'the ' + route + ' route' if route else 'a full checkpoint'} wrote it"
            )
        secs = time.perf_counter() - t0
        self.t["write"] += secs
        info = {"key": key, "seconds": round(secs, 3), "bytes": dir_bytes(target)}
        info["snapshot"] = integrity.snapshot(target)  # what the evaluation must leave as it is
        write_json(target.parent / f"{target.name}.key", info)
        return info

    def on_disk(self, target: Path, key: str) -> dict | None:
        try:
            info = read_json(
                target.parent / f"{target.name}.key", what="key file", roots=(realpath(self.stage),)
            )
        except InputError:
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
            adapter = self.as_adapter(cand)
            t0 = time.perf_counter()
            # an adapter is measured as the model it stands for, BASE + ΔW, as FT is
            if adapter:
                cand_ck = open_ft(str(cdir), base=self.base_ck, label="candidate")
            else:
                cand_ck = Checkpoint(cdir, label="candidate")
            try:
                dist = update_distance(self.base_ck, self.ft_cks, cand_ck)
            finally:
                cand_ck.close()
            dsecs = time.perf_counter() - t0
            self.t["distance"] += dsecs
            model, merged_bytes = cdir.resolve(), 0
            if adapter:  # evaluated as a full checkpoint, as FT was
                t1 = time.perf_counter()
                model = self.merged_adapter(str(cdir))
                merged_bytes = dir_bytes(model)
                self.t["write"] += time.perf_counter() - t1
            winner_bytes = dir_bytes(self.stage / "winner")
            self.disk_peak = max(self.disk_peak, winner_bytes + info["bytes"] + merged_bytes)
            try:
                rec, results = self.run_eval(model, name, self.base_rf.metrics)
            finally:
                if adapter:
                    shutil.rmtree(model, ignore_errors=True)
            tampered = integrity.changed(cdir, info.get("snapshot"))
            if tampered:
                rec["status"], results = "failed", None
                rec["message"] = (
                    f"the evaluation command changed the candidate it evaluated ({tampered}); its "
                    "results are discarded (evaluate {model} without writing into it)"
                )
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
            min_target_retention=self.bar,
        )

    def keep_or_drop(self, key: str, cached: bool) -> None:
        """Keep the candidate just written if it is the best so far, else delete it."""
        cdir = self.stage / "candidate"
        if cached or not cdir.exists():
            return
        winner, _ = choose_winner(self.rows, self.bar, self.opts.tie_tolerance)
        if winner is not None and winner["key"] == key:
            wdir = self.stage / "winner"
            shutil.rmtree(wdir, ignore_errors=True)
            (self.stage / "winner.key").unlink(missing_ok=True)
            os.replace(cdir, wdir)
            os.replace(self.stage / "candidate.key", self.stage / "winner.key")
        else:
            shutil.rmtree(cdir, ignore_errors=True)
            (self.stage / "candidate.key").unlink(missing_ok=True)
