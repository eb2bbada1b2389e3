"""LoRA outputs: which format a run writes, and any repair or merge written as a PEFT adapter.

:class:`AdapterOutput` makes the decisions before anything is computed:

- **format**: ``--format peft`` writes an adapter; ``--merge`` (only with adapter inputs) and
  ``--format full`` a full checkpoint; by default a run whose fine-tunes are all adapters writes
  an adapter, any other a full checkpoint;
- **spectral methods on adapters are degenerate** (SPEC §4): an adapter's update ``B·A`` has
  exactly r non-zero singular values, so the unknown-noise cut (from the median singular value)
  means nothing there; that is a one-line error offering what works — strengths (exact in
  adapter form), ``--noise known --sigma S`` (a defined threshold), or ``--merge``: repair the
  merged checkpoint (LoRA modules are then reported ``low-rank`` and keep their update, full
  tensors such as ``modules_to_save`` copies get the cut);
- an update that is not low-rank (TIES, DARE, strengths of full fine-tunes, RECALL, ``twoknob``
  with a bulk weight) written as an adapter needs ``--rank R``.

Two ways to the adapter (written by :class:`~dghard_cli.io.peft_writer.AdapterStage`):

- **exact** — a method linear in the task vectors, ``W = W_base + Σ_i c_i(tensor)·Δ_i`` (WiSE-FT:
  ``c = α``; task arithmetic: ``c_i = λ·w_i``; see :func:`linear_coefficients`), on fine-tunes
  that are all plain LoRA adapters: per module ``B = [c_1 s_1 B_1, c_2 s_2 B_2, …]`` and
  ``A = [A_1; A_2; …]`` (rank Σ r_i, as PEFT's ``add_weighted_adapter(combination_type="cat")``),
  full tensors combined elementwise; no base weight is read for the factors. ``--rank R``
  truncates the concatenation exactly (SVD of the factors, ``O((m+n) r²)``).
- **factored** — any method: each tensor's output ``W*`` is computed by the method exactly as
  for a full checkpoint (in float64), ``Δ* = W* − W_base`` is factored with the exact SVD at its
  numerical rank (the kept rank, for DG-Hard), capped by ``--rank`` (for TIES/DARE of adapters:
  by default the largest input rank of the module, PEFT's ``add_weighted_adapter`` default), with
  the energy lost recorded per module. A module whose factors would be larger than the matrix is
  written whole. Tensors are computed one at a time; only the small factors are spooled.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from dghard_cli.architecture import OUTPUT_HEAD, VOCAB_EMBEDDING
from dghard_cli.engine.device import resolve_device
from dghard_cli.engine.ops import JobInputs, TensorOp, base_record, passthrough
from dghard_cli.engine.pipeline import EngineOptions
from dghard_cli.engine.plan import Plan, TensorJob
from dghard_cli.engine.runner import RunOptions, fingerprint, inputs_doc, plan_records
from dghard_cli.errors import InputError, Interrupted, RuntimeFailure
from dghard_cli.io.adapter_source import CONV1D_MODEL_TYPES, AdapterCheckpoint, is_adapter
from dghard_cli.io.checkpoint import Checkpoint, FileReader, TensorInfo
from dghard_cli.io.lora_adapter import PEFT_PREFIX
from dghard_cli.io.output import check_out_path
from dghard_cli.io.peft_writer import (
    SPOOL_PREFIX,
    AdapterStage,
    adapter_config,
    check_modules_to_save,
    lora_keys,
    module_names,
)
from dghard_cli.io.safetensors_format import torch_dtype
from dghard_cli.report import build as report_mod
from dghard_cli.spectral.lowrank import factorize_certified, factorize_product, factors_from_gram, gram_add

FORMATS = ("auto", "full", "peft")
#: Methods whose update is not low-rank for full fine-tunes: ``--format peft`` needs ``--rank``.
NOT_LOW_RANK = frozenset(
    {"ties", "dare-linear", "dare-ties", "task-arithmetic", "wise-ft", "recall", "lines", "layer-strengths"}
)
#: A repair that is a layer-strength schedule alone (``--lines``/``--layer-strengths``, no filter).
SCHEDULE_METHODS = frozenset({"lines", "layer-strengths"})


@dataclass
class LoraOutputOptions:
    """``--format``, ``--merge`` and ``--rank``."""

    format: str = "auto"  # auto | full | peft
    merge: bool = False  # adapter inputs: write the full merged checkpoint
    rank: int | None = None  # cap of each module's rank in an adapter output (exact SVD)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise InputError(f"--format {self.format!r} is not one of {', '.join(FORMATS)}")
        if self.rank is not None and (
            isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1
        ):
            raise InputError(f"--rank must be a whole number >= 1, got {self.rank!r}")
        if self.merge and self.format == "peft":
            raise InputError(
                "--merge writes a full checkpoint and --format peft an adapter; give one of them"
            )

    def describe(self) -> dict:
        return {"format": self.format, "merge": self.merge, "rank": self.rank}


def linear_coefficients(method: str, params: dict) -> Callable[[str], list[float]] | None:
    """``c_i(tensor)`` of a method that is linear in the task vectors, ``W = W_base + Σ c_i Δ_i``;
    None for methods that are not (TIES, DARE, RECALL, spectral filters).

    A layer-wise schedule (``--lines A,B``: λ(ℓ) = A + B·ℓ/(L−1)) is linear too, with
    name-dependent coefficients; :meth:`AdapterOutput.write` multiplies these by each tensor's λ,
    so a schedule alone is ``[1]`` here and WiSE-FT under a schedule is ``[λ(ℓ)·α]``.
    """
    if method == "wise-ft":
        return lambda name: [float(params["alpha"])]
    if method == "task-arithmetic":
        lam = float(params["lambda"])
        return lambda name: [lam * float(w) for w in params["weights"]]
    if method in SCHEDULE_METHODS:
        return lambda name: [1.0]
    return None


def scheduled_coefficients(
    coeffs: Callable[[str], list[float]], plan: Plan, strengths
) -> Callable[[str], list[float]]:
    """``coeffs`` under a bound layer-strength schedule: each tensor's coefficients times its λ.

    λ is the one the plan's job carries (tied tensors share the input embedding's, as in a full
    checkpoint), else the schedule's for the tensor's place (a tensor the plan does not list)."""
    bound = {j.name: j.strength for j in plan.jobs if j.strength is not None}

    def scaled(name: str) -> list[float]:
        lam = bound.get(name)
        if lam is None:
            lam = strengths.for_tensor(name)[1]
        return [float(lam) * c for c in coeffs(name)]

    return scaled


def degenerate_message(ft: Checkpoint, command: str) -> str:
    ranks = ", ".join(str(r) for r in ft.describe().get("ranks", [])) or "r"
    offer = (
        "scale it with `dghard merge --method wise-ft --alpha A BASE ADAPTER --out OUT` (exact, writes "
        "an adapter)"
    )
    if command == "repair":
        offer += ", threshold it at a known noise level with `--noise known --sigma S`"
    return (
        f"FT {ft.source} is a PEFT LoRA adapter (rank {ranks}): its update B·A has only r non-zero "
        "singular values, so DG-Hard's unknown-noise cut (the median singular value) is undefined on it "
        f"(SPEC §4); {offer}, or add --merge to {command} the merged checkpoint (LoRA modules are then "
        "reported low-rank and keep their update, full tensors get the cut)"
    )


def ties_embeddings(ck: Checkpoint) -> bool:
    cfg = ck.config() or {}
    tie = bool(cfg.get("tie_word_embeddings", False))
    text = cfg.get("text_config")
    if isinstance(text, dict) and "tie_word_embeddings" in text:
        tie = tie or bool(text["tie_word_embeddings"])
    return tie


#: Updates larger than this (float32 bytes) wait for the factorisation's second pass on disk.
SPILL_BYTES = 64 * 1024 * 1024


_SCRATCH = itertools.count()


class _DeltaStore:
    """A tensor's float32 update as it arrives in row blocks: in memory, or in a scratch file in
    the staging directory (removed when done), read back block by block."""

    def __init__(self, directory: Path, shape: tuple[int, ...], *, spill: bool) -> None:
        self.shape = shape
        self.parts: list[torch.Tensor] = []
        self.rows: list[int] = []
        self.path = Path(directory) / f"{SPOOL_PREFIX}delta-{next(_SCRATCH)}.tmp" if spill else None
        self._fh = open(self.path, "wb") if self.path is not None else None  # noqa: SIM115 - closed in close()

    def append(self, d: torch.Tensor) -> None:
        if self._fh is None:
            self.parts.append(d)
        else:
            self._fh.write(memoryview(d.contiguous().reshape(-1).numpy()).cast("B"))
            self.rows.append(int(d.shape[0]))

    def finish(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def blocks(self):
        if self.path is None:
            yield from self.parts
            return
        reader = FileReader(self.path)
        row_floats = math.prod(self.shape[1:])
        offset = 0
        try:
            for n in self.rows:
                buf = torch.empty((n, *self.shape[1:]), dtype=torch.float32)
                reader.read_into(memoryview(buf.reshape(-1).view(torch.uint8).numpy()), offset, "scratch")
                offset += n * row_floats * 4
                yield buf
        finally:
            reader.close()

    def whole(self) -> torch.Tensor:
        return torch.cat(list(self.blocks()), dim=0) if len(self.shape) >= 1 else self.parts[0]

    def close(self) -> None:
        self.finish()
        self.parts = []
        if self.path is not None:
            self.path.unlink(missing_ok=True)


class AdapterOutput:
    """The output decisions of one run, and the adapter writer when the format is ``peft``."""

    def __init__(
        self,
        lora: LoraOutputOptions | None,
        base: Checkpoint,
        fts: list[Checkpoint],
        *,
        command: str,
        method: str,
        params: dict,
        spec=None,  # the repair's ShrinkSpec (None for merge)
        out_dtype: str | None = None,  # --dtype: of the factors and full tensors of an adapter output
    ) -> None:
        self.out_dtype = out_dtype
        self.lora = lora or LoraOutputOptions()
        self.base, self.fts = base, fts
        self.command, self.method, self.params, self.spec = command, method, params, spec
        flags = [is_adapter(f) for f in fts]
        any_adapter, all_adapters = any(flags), all(flags)
        if self.lora.merge and not any_adapter:
            raise InputError(
                "--merge merges a LoRA adapter into BASE, and FT is a full checkpoint already (drop --merge)"
            )
        if method == "recall" and any_adapter:
            raise InputError(
                "--method recall runs each fine-tuned model from its directory, and a LoRA adapter is not "
                "one; merge it first (`dghard merge --method task-arithmetic BASE ADAPTER --out FT --merge`)"
            )
        median = spec.noise == "median" if spec is not None else method == "dg-hard"
        if any_adapter and median and not self.lora.merge:
            raise InputError(degenerate_message(next(f for f in fts if is_adapter(f)), command))
        if self.lora.merge or self.lora.format == "full":
            self.format = "full"
        elif self.lora.format == "peft" or all_adapters:
            self.format = "peft"
        else:
            self.format = "full"
        if self.format == "full" and self.lora.rank is not None:
            raise InputError(
                "--rank limits the rank of an adapter output, and this run writes a full checkpoint; "
                "add --format peft (or drop --rank)"
            )
        coeffs = linear_coefficients(method, params) if spec is None else None
        self.coefficients = coeffs
        self.exact = (
            self.format == "peft" and all_adapters and coeffs is not None and all(f.linear for f in fts)  # type: ignore[attr-defined]
        )
        self.adapter_inputs = all_adapters
        if self.format == "peft" and not self.exact and self.lora.rank is None and not any_adapter:
            twoknob_bulk = spec is not None and spec.shrink == "twoknob" and spec.b != 0
            if method in NOT_LOW_RANK or twoknob_bulk:
                what = f"--method {method}" if spec is None else "--shrink twoknob with --b != 0"
                raise InputError(
                    f"--format peft: the update of {what} is not low-rank (it keeps every direction of "
                    "the delta); pass --rank R to truncate each module's update with the exact SVD (the "
                    "energy lost is reported per module), or write a full checkpoint"
                )

    def full_parameters(self) -> dict:
        """What a full-checkpoint run adds to its report parameters: the merge of adapter inputs."""
        return {"merge": True, "output_format": "full"} if self.adapter_inputs or self.lora.merge else {}

    # -- the adapter ------------------------------------------------------------------------------
    def write(
        self,
        *,
        out: Path,
        plan: Plan,
        make_op: Callable[[torch.device], TensorOp],
        run: RunOptions,
        parameters: dict,
        strengths=None,  # a bound layer-strength schedule (methods/schedule.py), or None
    ) -> dict:
        """Write the run's result as a PEFT adapter into OUT; returns the report document.

        With ``strengths`` the exact route scales each module's B (and each full tensor's update) by
        its λ(ℓ); the factored route gets the schedule through ``make_op`` (``schedule.wrap``)."""
        t_start = time.perf_counter()
        self._run_coefficients = self.coefficients
        self._lam: dict[str, tuple] = {}
        if strengths is not None and self.coefficients is not None:
            self._run_coefficients = scheduled_coefficients(self.coefficients, plan, strengths)
            self._lam = {j.name: (j.layer, j.strength) for j in plan.jobs if j.strength is not None}
        schedule_doc = {"layer_strengths": strengths.report()} if strengths is not None else {}
        base, fts = self.base, self.fts
        for j in plan.jobs:
            if j.action == "resized":
                raise InputError(
                    f"--format peft: tensor {j.name!r} was resized ({j.base.shape[0] if j.base else '?'} -> "
                    f"{j.shape[0]} rows); an adapter cannot change BASE's vocabulary — write a full checkpoint"
                )
            if j.reason == "ft-only":
                raise InputError(
                    f"--format peft: tensor {j.name!r} is in the fine-tune but not in BASE; an adapter cannot "
                    "add parameters — write a full checkpoint"
                )
        device = resolve_device(run.device)
        parameters = {**parameters, **self.lora.describe(), "output_format": "peft"}
        path = "exact" if self.exact else "factored"
        parameters["adapter_route"] = path
        common = dict(
            command=self.command,
            argv=run.argv,
            inputs=inputs_doc(base, fts),
            method=self.method,
            parameters=parameters,
            device=report_mod.device_info(device, run.device),
            notes=list(plan.notes),
            spectral=self.spec is not None and path == "factored",
        )
        check_out_path(Path(out), [base.path, *[f.path for f in fts]], overwrite=run.overwrite)
        if run.dry_run:
            doc = report_mod.build_report(
                output={
                    "path": str(out),
                    "format": "peft",
                    "dry_run": True,
                    "full_checkpoint_bytes": plan.out_bytes,
                },
                timings={"total": time.perf_counter() - t_start},
                memory=report_mod.peak_memory(),
                records=plan_records(plan),
                **common,
            )
            doc["summary"]["dry_run"] = True
            doc.update(schedule_doc)
            return doc
        fp = fingerprint(self.command, self.method, parameters, plan, [base, *fts])
        stage = AdapterStage(
            Path(out),
            fp,
            resume=run.resume,
            inputs=[base.path, *[f.path for f in fts]],
            overwrite=run.overwrite,
        )
        self._factor_dtype = self.out_dtype or "F32"
        timings: dict = {}
        t0 = time.perf_counter()
        try:
            if self.exact:
                units = self._exact_units(stage)
            else:
                self._stage = stage
                units = self._factored_units(stage, plan, make_op(device), device, run)
            timings["compute"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            items, config, summary = self._assemble(stage, units)
            records = [rec for _, rec in units]

            def documents(output: dict) -> dict[str, str]:
                timings["write"] = time.perf_counter() - t1
                timings["total"] = time.perf_counter() - t_start
                summary["bytes"] = output["bytes"]
                summary["full_checkpoint_bytes"] = plan.out_bytes
                summary["size_ratio"] = output["bytes"] / plan.out_bytes if plan.out_bytes else None
                doc = report_mod.build_report(
                    output={
                        "path": str(out),
                        "format": "peft",
                        "resumed_units": len(stage.stage.resumed),
                        **output,
                    },
                    timings=timings,
                    memory=report_mod.peak_memory(device),
                    records=records,
                    extra={"adapter": summary, "adapter_config": config, **schedule_doc},
                    **common,
                )
                self._doc = doc
                return {
                    "dghard_report.json": json.dumps(doc, indent=2) + "\n",
                    "README.md": adapter_card(doc),
                }

            stage.finish(items, config=config, tokenizer_dirs=self._tokenizer_dirs(), documents=documents)
        except KeyboardInterrupt:
            raise Interrupted(
                f"interrupted; finished modules are kept in {stage.dir}",
                hint="run the same command again to resume",
            ) from None
        except InputError:
            stage.discard()
            raise
        except MemoryError:
            raise RuntimeFailure(
                f"out of memory; finished modules are kept in {stage.dir}", hint="rerun the same command"
            ) from None
        except OSError as exc:
            raise RuntimeFailure(
                f"I/O error ({exc.strerror or exc}); finished modules are kept in {stage.dir}",
                hint="fix the cause (disk full?) and run the same command again to resume",
            ) from None
        return self._doc

    def _tokenizer_dirs(self) -> list[Path]:
        return [f.path for f in self.fts[:1]]

    # -- exact: linear methods on adapters --------------------------------------------------------
    def _exact_units(self, stage: AdapterStage) -> list[tuple[int, dict]]:
        base = self.base
        fts: list[AdapterCheckpoint] = self.fts  # type: ignore[assignment]
        coeffs = self._run_coefficients
        assert coeffs is not None
        order = {n: i for i, n in enumerate(base.tensors)}
        module_set = {m for f in fts for m in f.modules}
        modules = sorted(module_set, key=lambda m: order.get(f"{m}.weight", len(order)))
        full_names = set()
        for f in fts:
            full_names |= set(f.full)
            full_names |= {f"{d.module}.bias" for d in f.modules.values() if d.b_bias is not None}
        units: list[tuple[int, dict]] = []
        index = 0
        for m in modules:
            weight = f"{m}.weight"
            done = stage.resumed(index)
            if done is not None:
                units.append((index, done))
                index += 1
                continue
            c = coeffs(weight)
            parts = []
            kinds = set()
            for i, f in enumerate(fts):
                d = f.modules.get(m)
                if d is None or c[i] == 0:
                    continue
                b, a = d.factors()
                parts.append((b * (c[i] * d.scaling), a))
                kinds.add((d.embedding, d.transposed))
            rec = {"name": weight, "module": m, "action": "method", **self._strength_fields(weight)}
            if len(kinds) > 1:
                raise InputError(
                    f"module {m!r} is an embedding or Conv1D layer in one adapter and not in another; "
                    "these adapters are not for the same base"
                )
            if not parts:
                rec["written_as"] = "unchanged"
                units.append((index, rec))
                stage.put(index, {}, rec)
                index += 1
                continue
            embedding, transposed = kinds.pop()
            b = torch.cat([p[0] for p in parts], dim=1)
            a = torch.cat([p[1] for p in parts], dim=0)
            ranks_in = [p[0].shape[1] for p in parts]
            lost = 0.0
            if self.lora.rank is not None and b.shape[1] > self.lora.rank:
                fac = factorize_product(b, a, self.lora.rank)
                b, a, lost = fac.left, fac.right, fac.energy_lost
            rec.update(
                {
                    "written_as": "lora" if b.shape[1] else "unchanged",
                    "embedding": embedding,
                    "transposed": transposed,
                    "rank": int(b.shape[1]),
                    "ranks_in": ranks_in,
                    "coefficients": [float(x) for x in c],
                    "energy_lost": lost,
                }
            )
            dt = torch_dtype(self._factor_dtype)
            tensors = {"A": a.to(dt), "B": b.to(dt)} if b.shape[1] else {}
            stage.put(index, tensors, rec)
            units.append((index, rec))
            index += 1
        for name in sorted(full_names, key=lambda n: order.get(n, len(order))):
            done = stage.resumed(index)
            if done is not None:
                units.append((index, done))
                index += 1
                continue
            binfo = base.tensors[name]
            c = coeffs(name)
            w0 = binfo.read().to(torch.float64)
            w = w0.clone()
            for i, f in enumerate(fts):
                module = name.rsplit(".", 1)[0]
                src = (
                    f.full.get(name)
                    if (name.endswith(".weight") and module in f.modules)
                    else f.tensors[name]
                )
                if src is None or src is binfo or c[i] == 0:
                    continue
                if tuple(src.shape) != tuple(binfo.shape):
                    raise InputError(
                        f"--format peft: adapter {f.source} resizes {name!r} ({list(binfo.shape)} -> "
                        f"{list(src.shape)}); an adapter output cannot change BASE's shapes — add --merge"
                    )
                w.add_(src.read().to(torch.float64).sub_(w0), alpha=c[i])
            rec = {
                "name": name,
                "module": name.rsplit(".", 1)[0],
                "action": "method",
                "shape": list(binfo.shape),
                **self._strength_fields(name),
            }
            if bool(torch.equal(w, w0)):
                rec["written_as"] = "unchanged"
                stage.put(index, {}, rec)
            else:
                rec["written_as"] = "full"
                rec["delta_norm"] = float(torch.linalg.vector_norm(w - w0))
                stage.put(index, {"value": w.to(torch_dtype(self._full_dtype(binfo)))}, rec)
            units.append((index, rec))
            index += 1
        return units

    def _strength_fields(self, name: str) -> dict:
        """The report's per-tensor ``layer``/``layer_strength`` under a schedule (as in a full run)."""
        if name not in self._lam:
            return {}
        layer, lam = self._lam[name]
        return {"layer": layer, "layer_strength": lam}

    def _full_dtype(self, info: TensorInfo) -> str:
        return self.out_dtype or getattr(info, "output_dtype", None) or info.dtype

    # -- factored: any method ------------------------------------------------------------------------
    def _factored_units(
        self, stage: AdapterStage, plan: Plan, op: TensorOp, device: torch.device, run: RunOptions
    ) -> list[tuple[int, dict]]:
        """Every tensor of the plan, in order; on the CPU small ones two (or more) at a time, one
        thread each, as the streaming pipeline computes them (large ones alone, all threads)."""
        model_type = (self.base.config() or {}).get("model_type")
        caps = self._default_caps()
        units: list[tuple[int, dict]] = []
        opts = run.engine or EngineOptions.for_device(device)
        workers = max(1, opts.compute_workers)
        threads = torch.get_num_threads()
        pool = (
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dghard-adapter")
            if workers > 1
            else None
        )
        pending: deque = deque()

        def one(job: TensorJob) -> tuple[dict, dict[str, torch.Tensor]]:
            torch.set_num_threads(1)
            return self._factored_unit(job, op, device, run, caps, model_type)

        def flush(keep: int = 0) -> None:
            while len(pending) > keep:
                index, fut = pending.popleft()
                rec, tensors = fut.result()
                stage.put(index, tensors, rec)
                units.append((index, rec))

        try:
            for index, job in enumerate(plan.jobs):
                done = stage.resumed(index)
                if done is not None:
                    flush()
                    units.append((index, done))
                    continue
                if job.action == "tied":
                    flush()
                    units.append((index, self._tied_unit(stage, index, job, units)))
                    continue
                if pool is not None and job.in_nbytes <= opts.parallel_bytes:
                    pending.append((index, pool.submit(one, job)))
                    flush(keep=workers)
                    continue
                flush()
                torch.set_num_threads(threads)
                rec, tensors = self._factored_unit(job, op, device, run, caps, model_type)
                stage.put(index, tensors, rec)
                units.append((index, rec))
            flush()
        finally:
            for _, fut in pending:
                fut.cancel()
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
            torch.set_num_threads(threads)
        return units

    def _default_caps(self) -> dict[str, int]:
        """Per module, the largest input rank (adapter inputs only)."""
        caps: dict[str, int] = {}
        for f in self.fts:
            if isinstance(f, AdapterCheckpoint):
                for m, d in f.modules.items():
                    caps[m] = max(caps.get(m, 0), d.rank)
        return caps

    def _factored_unit(
        self, job: TensorJob, op: TensorOp, device: torch.device, run: RunOptions, caps: dict, model_type
    ) -> tuple[dict, dict[str, torch.Tensor]]:
        """One tensor: the method's output in float64, its update Δ* = W* − W_base, its factors.

        A tall matrix's float64 Gram is accumulated while the method's row blocks arrive and Δ*
        (float32) goes to a scratch file in the staging directory when it is large, for the second
        pass of the factorisation; W* itself is kept only for what is written whole (1-D tensors,
        updates that are not low-rank), so memory stays a few blocks plus the factors.
        """
        job64 = dataclasses.replace(job, out_dtype="F64")
        src = JobInputs(job64, None, allow_nonfinite=run.allow_nonfinite)
        rec = base_record(job)
        rec["module"] = job.name.rsplit(".", 1)[0] if "." in job.name else job.name
        t0 = time.perf_counter()
        if job.runs_method:
            blocks = op(job64, src, rec)
        else:
            blocks = passthrough(job64, src, rec, "base" if job.action == "kept-base" else "ft0")
        shape = tuple(job.shape)
        out_dt = torch_dtype(job.out_dtype)
        lora_able = len(shape) == 2 and job.name.endswith(".weight")
        tall = lora_able and shape[0] >= shape[1]
        value = None if lora_able else torch.empty(shape, dtype=out_dt)
        store = _DeltaStore(self._stage.dir, shape, spill=tall and math.prod(shape) * 4 > SPILL_BYTES)
        nonzero, finite, r0 = False, True, 0
        try:
            for blk in blocks:
                t = blk.view(torch.float64) if blk.dtype == torch.uint8 else blk.to(torch.float64)
                if len(shape) >= 2:
                    t = t.reshape(-1, *shape[1:])
                    rows = (r0, r0 + t.shape[0])
                    b = job.base.read(rows) if job.base is not None else None
                else:
                    t = t.reshape(shape)
                    rows = None
                    b = job.base.read() if job.base is not None else None
                if value is not None:
                    if rows is None:
                        value.copy_(t)
                    else:
                        value[rows[0] : rows[1]] = t
                if b is not None:
                    t.sub_(b.to(torch.float64))
                d32 = t.to(torch.float32)
                del t, b
                nonzero = nonzero or bool(torch.any(d32 != 0))
                finite = finite and bool(torch.isfinite(d32).all())
                store.append(d32)
                if rows is not None:
                    r0 = rows[1]
            del blocks
            store.finish()
            if not nonzero:
                rec["written_as"] = "unchanged"
                rec["seconds"] = round(time.perf_counter() - t0, 6)
                return rec, {}
            if lora_able and finite:
                module = rec["module"]
                cap = self.lora.rank if self.lora.rank is not None else caps.get(module)
                kept = rec.get("low_rank") if rec.get("reason") == "low-rank" else rec.get("rank_kept")
                hint = kept or cap or 16
                fac = self._factors(store, shape, cap, int(hint), device)
                rec["factor_route"] = fac[1]
                fac = fac[0]
                m, n = shape
                if fac.rank and (fac.rank * (m + n) < m * n or cap is not None):
                    embedding = bool(VOCAB_EMBEDDING.search(job.name))
                    transposed = embedding or (
                        model_type in CONV1D_MODEL_TYPES and not OUTPUT_HEAD.search(job.name)
                    )
                    a, b = (fac.left.T, fac.right.T) if transposed else (fac.right, fac.left)
                    dt = torch_dtype(self._factor_dtype)
                    rec.update(
                        {
                            "written_as": "lora",
                            "embedding": embedding,
                            "transposed": transposed,
                            "rank": fac.rank,
                            "lora": fac.stats(),
                            "energy_lost": fac.energy_lost,
                        }
                    )
                    rec["seconds"] = round(time.perf_counter() - t0, 6)
                    return rec, {"A": a.contiguous().to(dt), "B": b.contiguous().to(dt)}
            if value is None:  # written whole after all: W* = W_base + Δ*, to float32 rounding of Δ*
                value = torch.empty(shape, dtype=out_dt)
                r = 0
                for d in store.blocks():
                    rows = (r, r + d.shape[0])
                    base = job.base.read(rows).to(torch.float64) if job.base is not None else 0.0
                    value[rows[0] : rows[1]] = d.to(torch.float64) + base
                    r = rows[1]
            rec["written_as"] = "full"
            rec["seconds"] = round(time.perf_counter() - t0, 6)
            return rec, {"value": value}
        finally:
            store.close()

    @staticmethod
    def _factors(store: _DeltaStore, shape: tuple[int, int], cap: int | None, hint: int, device) -> tuple:
        """Exact factors of a stored update: the certified two-pass route when no rank limit
        applies and the update is low-rank (DG-Hard's result, adapters), else the exact SVD from
        the float64 Gram matrix (truncated to ``cap``)."""
        m, n = shape
        tall = m >= n
        if tall:
            blocks = store.blocks
        else:
            x = store.whole().T

            def blocks():
                step = max(1, (32 << 20) // max(1, 8 * m))
                return (x[r : r + step] for r in range(0, x.shape[0], step))

        tall_shape = (m, n) if tall else (n, m)
        fac = None
        if cap is None and 2 * hint + 8 < min(m, n):
            fac = factorize_certified(blocks, tall_shape, 2 * hint + 8, device=device)
        route = "range-finder-certified" if fac is not None else "gram-eigh-float64"
        if fac is None:
            g = torch.zeros((tall_shape[1], tall_shape[1]), dtype=torch.float64, device=device)
            for xb in blocks():
                gram_add(g, xb)
            fac = factors_from_gram(g, tall_shape, blocks, cap)
        if not tall:
            fac = dataclasses.replace(fac, left=fac.right.T.contiguous(), right=fac.left.T.contiguous())
        return fac, route

    def _tied_unit(
        self, stage: AdapterStage, index: int, job: TensorJob, units: list[tuple[int, dict]]
    ) -> dict:
        rec = base_record(job)
        rec["module"] = job.name.rsplit(".", 1)[0]
        src = next((r for _, r in units if r["name"] == job.tied_to), None)
        rec["written_as"] = "tied"
        if src is not None and src.get("written_as") == "full":
            raise InputError(
                f"--format peft: {job.name!r} is tied to {job.tied_to!r}, whose update is written whole "
                "(modules_to_save); PEFT cannot keep such a copy tied — write a full checkpoint"
            )
        stage.put(index, {}, rec)
        return rec

    # -- assembling the adapter ----------------------------------------------------------------------
    def _assemble(self, stage: AdapterStage, units: list[tuple[int, dict]]) -> tuple[list, dict, dict]:
        base = self.base
        modules = module_names(base.tensors)
        tie = ties_embeddings(base)
        lora: dict[str, tuple[int, dict]] = {}
        full: dict[str, tuple[int, dict]] = {}
        tied_twins = [r for _, r in units if r.get("written_as") == "tied"]
        for idx, rec in units:
            if rec.get("written_as") == "lora":
                lora[rec["module"]] = (idx, rec)
            elif rec.get("written_as") == "full":
                full[rec["name"]] = (idx, rec)
        items: list[tuple[str, TensorInfo]] = []
        # a tied output layer's low-rank update goes on the input embedding, whose LoRA PEFT ties
        # to the output layer (ensure_weight_tying); inputs' own tying layout is kept as it is
        relocate = tie and not self.exact
        twin_of = {r["tied_to"]: r["name"] for r in tied_twins if r.get("tied_to")}
        tied_lora = any(
            bool(f.adapter.config_raw.get("ensure_weight_tying"))
            for f in self.fts
            if isinstance(f, AdapterCheckpoint)
        )
        ranks: dict[str, int] = {}
        for m, (idx, rec) in lora.items():
            t = stage.spooled(idx)
            a, b = t["A"], t["B"]
            target, embedding = m, bool(rec.get("embedding"))
            if relocate and not embedding and OUTPUT_HEAD.search(rec["name"]):
                twin = twin_of.get(rec["name"])
                if twin is None or not VOCAB_EMBEDDING.search(twin):
                    raise InputError(
                        f"--format peft: {rec['name']!r} is tied to an input embedding that BASE does not "
                        "store under a known name; write a full checkpoint"
                    )
                target, embedding = twin.rsplit(".", 1)[0], True
                a, b = _transposed_view(b), _transposed_view(a)
                rec["written_on"] = target
            if relocate and embedding:
                tied_lora = True
            ranks[target] = int(rec["rank"])
            key_a, key_b = lora_keys(target, embedding)
            items += [(key_a, a), (key_b, b)]
        modules_to_save: set[str] = set()
        lora_bias = False
        for name, (idx, _rec) in full.items():
            if "." not in name:
                raise InputError(f"--format peft: tensor {name!r} is not a module parameter PEFT can save")
            m, p = name.rsplit(".", 1)
            value = stage.spooled(idx)["value"]
            if m in ranks:
                items.append((f"{PEFT_PREFIX}{m}.base_layer.{p}", value))
                lora_bias = lora_bias or p == "bias"
            else:
                modules_to_save.add(m)
                items.append((f"{PEFT_PREFIX}{name}", value))
        if tie and any(
            VOCAB_EMBEDDING.search(f"{m}.weight") or OUTPUT_HEAD.search(f"{m}.weight")
            for m in modules_to_save
        ):
            raise InputError(
                "--format peft: the tied embeddings change in a way that is not low-rank, and PEFT cannot keep "
                "a whole copy of them tied (modules_to_save); write a full checkpoint"
            )
        check_modules_to_save(sorted(modules_to_save), modules)
        for m in sorted(modules_to_save):
            for n, info in base.tensors.items():
                if n.rsplit(".", 1)[0] == m and n not in full:
                    items.append((f"{PEFT_PREFIX}{n}", info))
        lora_units = [rec for _, rec in lora.values()]
        fan_in_fan_out = any(r.get("transposed") and not r.get("embedding") for r in lora_units)
        config = adapter_config(
            ranks=ranks,
            modules=modules,
            modules_to_save=sorted(modules_to_save),
            bias="lora_only" if lora_bias else "none",
            fan_in_fan_out=fan_in_fan_out,
            base_model=base.source,
            revision=base.revision,
            task_type=self._task_type(),
            tie_embeddings=bool(tied_lora),
        )
        rank_list = [int(r["rank"]) for r in lora_units]
        lost = [float(r.get("energy_lost", 0.0)) for r in lora_units]
        summary = {
            "lora_modules": len(lora_units),
            "full_tensors": len(full),
            "modules_to_save": sorted(modules_to_save),
            "r": config["r"],
            "rank_median": statistics.median(rank_list) if rank_list else None,
            "rank_max": max(rank_list) if rank_list else None,
            "rank_pattern_entries": len(config["rank_pattern"]),
            "energy_lost_max": max(lost) if lost else 0.0,
            "tied_embeddings": bool(tied_lora),
            "rank_cap": (
                f"--rank {self.lora.rank}"
                if self.lora.rank is not None
                else (
                    "the largest input rank of each module"
                    if not self.exact and self._default_caps()
                    else None
                )
            ),
            "route": "exact" if self.exact else "factored",
        }
        return items, config, summary

    def _task_type(self) -> str | None:
        types = {f.adapter.config_raw.get("task_type") for f in self.fts if isinstance(f, AdapterCheckpoint)}
        types.discard(None)
        if len(types) == 1:
            return types.pop()
        archs = (self.base.config() or {}).get("architectures") or []
        if any(isinstance(a, str) and a.endswith("ForCausalLM") for a in archs):
            return "CAUSAL_LM"
        if any(isinstance(a, str) and a.endswith("ForConditionalGeneration") for a in archs):
            return "SEQ_2_SEQ_LM"
        return None


def _transposed_view(info: TensorInfo) -> TensorInfo:
    """A spooled 2-D factor read back transposed (the tied embedding's orientation)."""
    from dghard_cli.io.adapter_source import ComputedTensorInfo

    rows, cols = info.shape
    return ComputedTensorInfo(
        name=info.name,
        dtype="F32",
        shape=(cols, rows),
        shard=info.shard,
        file=info.file,
        offset=0,
        nbytes=rows * cols * 4,
        reader=info.reader,
        compute=lambda r, _i=info: _slice(_i.read().T, r),
        output_dtype=info.dtype,
    )


def _slice(t: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    return (t if rows is None else t[rows[0] : rows[1]]).to(torch.float64)


def adapter_card(doc: dict) -> str:
    """README.md of an adapter output: what was done and how to load it."""
    a = doc.get("adapter", {})
    base = doc["inputs"]["base"]["source"]
    mib = (a.get("bytes") or 0) / 2**20
    full = (a.get("full_checkpoint_bytes") or 0) / 2**20
    lines = [
        "---",
        "library_name: peft",
        f"base_model: {base}",
        "tags:",
        "- dghard",
        f"- {doc['method']}",
        "---",
        "",
        f"# {doc['method']} as a PEFT LoRA adapter",
        "",
        f"Made by `dghard {doc['command']}` (dghard {doc['tool']['version']}) on {doc['created']}.",
        "",
        f"- {a.get('lora_modules', 0)} LoRA modules (rank median {a.get('rank_median')}, max {a.get('rank_max')}; "
        f"scaling 1), {a.get('full_tensors', 0)} full tensors"
        + (f" (modules_to_save: {', '.join(a['modules_to_save'])})" if a.get("modules_to_save") else ""),
        f"- {mib:.2f} MiB, against {full:.2f} MiB for the full checkpoint",
        f"- largest share of a module's update lost to the rank cut: {a.get('energy_lost_max', 0):.3g}",
        *(
            [f"- layer-wise strengths λ(ℓ): {doc['layer_strengths']['summary']}"]
            if doc.get("layer_strengths")
            else []
        ),
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        "from peft import PeftModel",
        "",
        f"model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({base!r}), 'THIS_DIR')",
        "merged = model.merge_and_unload()  # a plain transformers model",
        "```",
        "",
        "`dghard_report.json` holds every module's rank, energy and timings.",
        "",
    ]
    return "\n".join(lines)
