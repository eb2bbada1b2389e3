"""LoRA outputs: which format a run writes, and any repair or merge written as a PEFT adapter.

:class:`AdapterOutput` makes the decisions before anything is computed:

- **format**: ``--format peft`` writes an adapter; ``--merge`` (only with adapter inputs) and
  ``--format full`` a full checkpoint; by default a run whose fine-tunes are all adapters writes
  an adapter, any other a full checkpoint;
- **spectral methods on adapters are degenerate**: an adapter's update ``B·A`` has
  exactly r non-zero singular values, so the unknown-noise cut (from the median singular value)
  means nothing there; that is a one-line error offering what works — strengths (exact in
  adapter form), ``--noise known --sigma S`` (a defined threshold), or ``--merge``: repair the
  merged checkpoint (LoRA modules are then reported ``low-rank`` and keep their update, full
  tensors such as ``modules_to_save`` copies get the cut);
- an update that is not low-rank (TIES, DARE, strengths of full fine-tunes, RECALL, ``twoknob``
  with a bulk weight) written as an adapter needs ``--rank R``;
- **exact or loud**: an adapter output holds the run's result exactly, or the run is refused
  (exit 2, nothing written) with one line saying how much of the update would be lost and what
  gives the exact model (:func:`lossy_message`), unless the cut was asked for: ``--rank R`` given,
  or ``--allow-lossy``. The report's ``adapter`` section says ``exact`` and ``energy_kept``.

Two ways to the adapter (written by :class:`~dghard_cli.lora.writer.AdapterStage`; each in its
own module, :mod:`~dghard_cli.lora.route_exact` and :mod:`~dghard_cli.lora.route_factored`,
assembled into PEFT's layout by :mod:`~dghard_cli.lora.assemble`; :meth:`AdapterOutput.write`
gives each the run's :class:`~dghard_cli.lora.context.RouteContext`, built once):

- **exact** — a method linear in the task vectors, ``W = W_base + Σ_i c_i(tensor)·Δ_i`` (WiSE-FT:
  ``c = α``; task arithmetic: ``c_i = λ·w_i``; see :func:`linear_coefficients`), on fine-tunes
  that are all plain LoRA adapters: per module ``B = [c_1 s_1 B_1, c_2 s_2 B_2, …]`` and
  ``A = [A_1; A_2; …]`` (rank Σ r_i, as PEFT's ``add_weighted_adapter(combination_type="cat")``),
  full tensors combined elementwise; no base weight is read for the factors. ``--rank R``
  truncates the concatenation exactly (SVD of the factors, ``O((m+n) r²)``). DoRA inputs give a
  DoRA output, each row of B scaled and the magnitude recomputed (:mod:`~dghard_cli.lora.dora`),
  when every module is a Linear layer (:func:`~dghard_cli.lora.route_exact.dora_blocker`).
- **factored** — any method: each tensor's output ``W*`` is computed by the method exactly as
  for a full checkpoint (in float64), ``Δ* = W* − W_base`` is factored with the exact SVD at its
  numerical rank (the kept rank, for DG-Hard), capped by ``--rank`` (for TIES/DARE of adapters:
  by default the largest input rank of the module, PEFT's ``add_weighted_adapter`` default), with
  the energy lost recorded per module. A module whose factors would be larger than the matrix is
  written whole. Tensors are computed one at a time; only the small factors are spooled.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from dghard_cli.engine.ops import TensorOp
from dghard_cli.engine.plan import TensorJob
from dghard_cli.engine.runner import CheckpointKind
from dghard_cli.engine.writer import OutputKind, OutputTarget, WriteRequest, dry_run_report, write_output
from dghard_cli.errors import InputError
from dghard_cli.io.checkpoint import Checkpoint
from dghard_cli.io.output import OutputStage
from dghard_cli.io.report_json import json_text
from dghard_cli.lora.assemble import assemble
from dghard_cli.lora.card import adapter_card
from dghard_cli.lora.context import RouteContext, input_ranks
from dghard_cli.lora.route_exact import dora_blocker, exact_units, uses_dora
from dghard_cli.lora.route_factored import factored_units
from dghard_cli.lora.source import AdapterCheckpoint, is_adapter
from dghard_cli.lora.writer import ADAPTER_FILES, AdapterStage, tokenizer_files
from dghard_cli.report import build as report_mod

FORMATS = ("auto", "full", "peft")
#: Methods whose update is not low-rank for full fine-tunes: ``--format peft`` needs ``--rank``.
NOT_LOW_RANK = frozenset(
    {
        "ties",
        "dare-linear",
        "dare-ties",
        "task-arithmetic",
        "wise-ft",
        "recall",
        "lines",
        "layer-strengths",
        "iso-c",  # a flat spectrum over the whole rank of Σ Δ_i
        "iso-cts",  # a flat spectrum over all min(m, n) directions
        "cart",  # the mean task vector plus low-rank parts
        "wudi",  # the sum of the task vectors in the directions the descent leaves
    }
)
#: A repair that is a layer-strength schedule alone (``--lines``/``--layer-strengths``, no filter).
SCHEDULE_METHODS = frozenset({"lines", "layer-strengths"})


@dataclass
class LoraOutputOptions:
    """``--format``, ``--merge``, ``--rank`` and ``--allow-lossy``."""

    format: str = "auto"  # auto | full | peft
    merge: bool = False  # adapter inputs: write the full merged checkpoint
    rank: int | None = None  # cap of each module's rank in an adapter output (exact SVD)
    allow_lossy: bool = False  # write an adapter that cuts the update (default rank cap) anyway
    core_space: bool = False  # merge LoRA adapters in their shared core space (merge only)

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
        if self.core_space and (self.merge or self.format == "full"):
            raise InputError(
                "--core-space merges LoRA adapters into an adapter, and --merge/--format full asks for a "
                "full checkpoint; drop one of them"
            )

    def describe(self) -> dict:
        doc = {
            "format": self.format,
            "merge": self.merge,
            "rank": self.rank,
            "allow_lossy": self.allow_lossy,
        }
        if self.core_space:  # only when asked: the reports of other runs keep their keys
            doc["core_space"] = True
        return doc

    @property
    def cut_asked(self) -> str | None:
        """The option by which the user asked for a lossy adapter (None: they did not)."""
        if self.rank is not None:
            return f"--rank {self.rank}"
        return "--allow-lossy" if self.allow_lossy else None


#: A module's update is exact when the factors keep every numerically resolved direction; these
#: records (``exact`` missing) are counted exact only with at most this share of energy lost.
LOSSLESS_SHARE = 1e-9


def energy_account(records: list[dict]) -> dict:
    """What the adapter keeps of the update of its LoRA modules (the report's ``adapter`` fields):
    ``exact``, ``energy_kept`` (share of the energy of all their updates), ``lossy_modules``, the
    worst module, and ``exact_rank`` (the largest numerical rank of a cut module: ``--rank`` at
    which nothing is cut)."""
    lora = [r for r in records if r.get("written_as") == "lora"]
    total = lost = 0.0
    cut = []
    for r in lora:
        e = float(r.get("update_energy") or 0.0)
        share = float(r.get("energy_lost") or 0.0)
        total += e
        lost += share * e
        if not r.get("exact", share <= LOSSLESS_SHARE):
            cut.append(r)
    worst = max(cut, key=lambda r: float(r.get("energy_lost") or 0.0), default=None)
    ranks = [int((r.get("lora") or {}).get("numerical_rank") or r.get("numerical_rank") or 0) for r in cut]
    return {
        "exact": not cut,
        "energy_kept": 1.0 - lost / total if total > 0 else 1.0,
        "lossy_modules": len(cut),
        "worst_module": worst.get("written_on") or worst["module"] if worst is not None else None,
        "exact_rank": max(ranks) if ranks and all(ranks) else None,
    }


def lossy_message(account: dict, records: list[dict], cap_description: str) -> str:
    """The one line that refuses a lossy adapter nobody asked for."""
    lora = [r for r in records if r.get("written_as") == "lora"]
    caps = sorted({int(r["rank"]) for r in lora if not r.get("exact", True)})
    kept = 100 * account["energy_kept"]
    worst = max(float(r.get("energy_lost") or 0.0) for r in lora)
    at = f"--rank {caps[-1]} keeps {'at least ' if len(caps) > 1 else ''}{kept:.1f} %"
    exact = (
        f"--rank {account['exact_rank']} keeps all of it (each module's numerical rank)"
        if account.get("exact_rank")
        else None
    )
    ways = ", ".join(w for w in ("--merge writes the exact merged model", exact, at) if w)
    return (
        f"--format peft: this adapter would not be exact: cut to {cap_description} it loses "
        f"{100 - kept:.1f} % of the update's energy ({account['lossy_modules']} of {len(lora)} modules "
        f"cut, up to {100 * worst:.1f} % of one module's: {account['worst_module']}); {ways}; or add "
        "--allow-lossy "
        "to write the cut adapter"
    )


#: Bytes of each stored tensor compared at a time (an embedding copy can be gigabytes).
COMPARE_BYTES = 64 * 1024 * 1024


def _same_values(a, b) -> bool:
    """Two stored tensors hold the same values (in any floating dtypes), compared in row blocks."""
    if tuple(a.shape) != tuple(b.shape):
        return False
    rows = a.shape[0] if a.shape else 1
    step = max(1, COMPARE_BYTES // max(1, a.row_bytes, b.row_bytes))
    for r in range(0, rows, step):
        span = (r, min(rows, r + step)) if a.shape else None
        if a.dtype == b.dtype:
            same = torch.equal(a.read_raw(span), b.read_raw(span))
        else:
            same = torch.equal(a.read(span).to(torch.float64), b.read(span).to(torch.float64))
        if not same:
            return False
    return True


def core_blocker(ft: Checkpoint, base: Checkpoint, lora_modules: set[str]) -> str | None:
    """Why an adapter cannot be merged in the core space (None: it can): every update of a
    module some adapter adapts (``lora_modules``) must be exactly ``s·B·A`` on BASE's weight, so
    DoRA, ``lora_bias``, and a whole weight an adapter stores for such a module (a replaced base
    weight, a ``modules_to_save`` copy) cannot, unless it holds BASE's values (PEFT's copy of an
    embedding it adapts, ``save_embedding_layers``)."""
    if not isinstance(ft, AdapterCheckpoint):
        return None
    for m, d in ft.modules.items():
        if d.magnitude is not None:
            return f"{ft.source} is a DoRA adapter (module {m!r}), whose update is not a product B·A"
        if d.b_bias is not None:
            return f"module {m!r} of {ft.source} has lora_bias, which the cores do not hold"
    for name, own in ft.full.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module not in lora_modules:
            continue
        if name not in base.tensors or not _same_values(own, base.tensors[name]):
            how = "replaces the base weight of" if module in ft.modules else "stores a whole copy of"
            return f"{ft.source} {how} {module!r}, which an adapter adapts with LoRA"
    return None


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
    coeffs: Callable[[str], list[float]], lam: dict[str, float], strengths
) -> Callable[[str], list[float]]:
    """``coeffs`` under a bound layer-strength schedule: each tensor's coefficients times its λ.

    ``lam``: the λ of each of the plan's jobs (tied tensors share the input embedding's, as in a
    full checkpoint); a tensor the plan does not list takes the schedule's λ for its place."""

    def scaled(name: str) -> list[float]:
        factor = lam.get(name)
        if factor is None:
            factor = strengths.for_tensor(name)[1]
        return [float(factor) * c for c in coeffs(name)]

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
        "singular values, so DG-Hard's unknown-noise cut (the median singular value) is undefined on it; "
        f"{offer}, or add --merge to {command} the merged checkpoint (LoRA modules are then "
        "reported low-rank and keep their update, full tensors get the cut)"
    )


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
        core_kind: str | None = None,  # --core-space: the method's MergeMethod.core_space
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
        if self.format == "full" and self.lora.allow_lossy:
            raise InputError(
                "--allow-lossy lets an adapter output cut the update, and this run writes a full "
                "checkpoint (exact); drop --allow-lossy"
            )
        #: --core-space: "lossless" or "cores" (see MergeMethod.core_space); None: not asked
        self.core_kind = self._core_space(core_kind, fts) if self.lora.core_space else None
        coeffs = linear_coefficients(method, params) if spec is None else None
        self.coefficients = coeffs
        linear = self.format == "peft" and all_adapters and coeffs is not None and self.core_kind is None
        #: why DoRA inputs cannot give a DoRA output (the factored route then cuts the update)
        self.dora_blocker = dora_blocker(fts) if linear and uses_dora(fts) else None
        self.exact = linear and self.dora_blocker is None
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

    def _core_space(self, kind: str | None, fts: list[Checkpoint]) -> str:
        """The core-space kind, once ``--core-space`` is known to apply to this run."""
        if self.command != "merge":
            raise InputError("--core-space merges several LoRA adapters: it is an option of `dghard merge`")
        lora_modules = {m for f in fts if isinstance(f, AdapterCheckpoint) for m in f.modules}
        for f in fts:
            if not is_adapter(f):
                raise InputError(
                    f"--core-space merges LoRA adapters in their shared core space, and {f.source} is a full "
                    "checkpoint; drop --core-space"
                )
            blocked = core_blocker(f, self.base, lora_modules)
            if blocked is not None:
                raise InputError(f"--core-space: {blocked}; merge without --core-space")
        if kind is None:  # merge() names the methods that can
            raise InputError(f"--core-space: --method {self.method} cannot run on the adapters' cores")
        return kind

    def full_parameters(self) -> dict:
        """What a full-checkpoint run adds to its report parameters: the merge of adapter inputs."""
        return {"merge": True, "output_format": "full"} if self.adapter_inputs or self.lora.merge else {}

    # -- the output -----------------------------------------------------------------------------
    def kind(
        self,
        *,
        make_core_op: Callable[[torch.device], TensorOp] | None = None,  # --core-space: the op for cores
        core_rule: Callable[[TensorJob], bool] | None = None,  # --core-space: the modules merged so
    ) -> OutputKind:
        """The kind of output this run writes: a PEFT adapter or a full checkpoint."""
        if self.format == "peft":
            return AdapterKind(self, make_core_op=make_core_op, core_rule=core_rule)
        return CheckpointKind(self.full_parameters())

    def write(self, req: WriteRequest, **core) -> dict:
        """Write the run ``req`` describes in this run's format; returns the report document."""
        return write_output(req, self.kind(**core))

    def tokenizer_dirs(self) -> list[Path]:
        return [f.path for f in self.fts[:1]]


class AdapterKind:
    """A run's result written as a PEFT adapter: the adapter kind of the one writer
    (:func:`~dghard_cli.engine.writer.write_output`).

    With a layer-strength schedule (``req.strengths``) the exact route scales each module's B
    (and each full tensor's update) by its λ(ℓ); the factored route gets the schedule through
    ``req.make_op`` (``schedule.wrap``)."""

    unit = "modules"

    def __init__(
        self,
        decision: AdapterOutput,
        *,
        make_core_op: Callable[[torch.device], TensorOp] | None,
        core_rule: Callable[[TensorJob], bool] | None,
    ) -> None:
        self.t_start = time.perf_counter()
        self.decision = decision
        self.make_core_op, self.core_rule = make_core_op, core_rule
        self.route = "exact" if decision.exact else "core-space" if decision.core_kind else "factored"

    def prepare(self, req: WriteRequest, device: torch.device) -> set[str]:
        """An adapter cannot resize BASE's vocabulary or add tensors; the names OUT gets."""
        for j in req.plan.jobs:
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
        tokenizer = set().union(*(tokenizer_files(d) for d in self.decision.tokenizer_dirs()))
        return set(ADAPTER_FILES) | tokenizer

    def announce(self, req: WriteRequest) -> None:
        pass  # the input checks compare full checkpoints: an adapter run has none to print

    def discard_on_bad_input(self) -> bool:
        return True  # a refusal (a lossy adapter, a non-finite factor) leaves nothing behind

    def parameters(self, req: WriteRequest) -> dict:
        d = self.decision
        parameters = {**req.parameters, **d.lora.describe(), "output_format": "peft"}
        parameters["adapter_route"] = self.route
        if d.core_kind is not None:
            parameters["core_space_merge"] = d.core_kind
        return parameters

    def spectral(self, req: WriteRequest) -> bool:
        return self.decision.spec is not None and self.route == "factored"

    def _schedule_doc(self, req: WriteRequest) -> dict:
        return {"layer_strengths": req.strengths.report()} if req.strengths is not None else {}  # type: ignore[attr-defined]

    def dry_run(self, req: WriteRequest, common: dict) -> dict:
        output = {
            "path": str(req.out),
            "format": "peft",
            "dry_run": True,
            "full_checkpoint_bytes": req.plan.out_bytes,
        }
        return dry_run_report(req, output, common, {"total": time.perf_counter() - self.t_start})

    def open_stage(self, req: WriteRequest, fp: str) -> OutputStage:
        self.stage = AdapterStage(req.out, fp, resume=req.run.resume, overwrite=req.run.overwrite)
        return self.stage.stage

    def write(self, req: WriteRequest, target: OutputTarget, common: dict, device: torch.device) -> dict:
        """Compute the units (exact or factored route), refuse a cut nobody asked for, assemble
        PEFT's layout and write it with its report and model card."""
        d, stage, plan = self.decision, self.stage, req.plan
        run_coefficients = d.coefficients
        layer_strengths: dict[str, tuple] = {}
        if req.strengths is not None and d.coefficients is not None:
            layer_strengths = {j.name: (j.layer, j.strength) for j in plan.jobs if j.strength is not None}
            lam = {name: strength for name, (_, strength) in layer_strengths.items()}
            run_coefficients = scheduled_coefficients(d.coefficients, lam, req.strengths)
        ctx = RouteContext(
            base=d.base,
            fts=tuple(d.fts),
            exact=d.exact,
            rank=d.lora.rank,
            factor_dtype=d.out_dtype or "F32",
            out_dtype=d.out_dtype,
            coefficients=run_coefficients,
            layer_strengths=layer_strengths,
            input_ranks=input_ranks(d.fts),
            core_rule=self.core_rule,
            core_kind=d.core_kind,
            skip_untouched=d.command == "merge",
        )
        timings: dict = {}
        t0 = time.perf_counter()
        if d.exact:
            units = exact_units(ctx, stage)
        else:
            use_core = self.make_core_op is not None and self.core_rule is not None
            core_op = self.make_core_op(device) if use_core else None  # type: ignore[misc]
            units = factored_units(ctx, stage, plan, req.make_op(device), device, req.run, core_op)
        timings["compute"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        records = [rec for _, rec in units]
        account = energy_account(records)
        if not account["exact"] and d.lora.cut_asked is None:
            why = f" (DoRA cannot stay DoRA here: {d.dora_blocker})" if d.dora_blocker else ""
            raise InputError(lossy_message(account, records, _cap_description(ctx)) + why)
        items, config, summary = assemble(ctx, stage, units)
        summary.update(account)
        summary["cut_by"] = None if account["exact"] else d.lora.cut_asked
        written: dict = {}  # the report document, once documents() has built it

        def documents(output: dict) -> dict[str, str]:
            timings["write"] = time.perf_counter() - t1
            timings["total"] = time.perf_counter() - self.t_start
            summary["bytes"] = output["bytes"]
            summary["full_checkpoint_bytes"] = plan.out_bytes
            summary["size_ratio"] = output["bytes"] / plan.out_bytes if plan.out_bytes else None
            doc = report_mod.build_report(
                output={
                    "path": str(req.out),
                    "format": "peft",
                    "resumed_units": len(stage.stage.resumed),
                    **output,
                },
                timings=timings,
                memory=report_mod.peak_memory(device),
                records=records,
                extra={"adapter": summary, "adapter_config": config, **self._schedule_doc(req)},
                **common,
            )
            written["doc"] = doc
            docs = {"README.md": adapter_card(doc)}
            if target.rel_report is not None:  # the default OUT/dghard_report.json, or --report inside OUT
                docs[target.rel_report] = json_text(doc)
            return docs

        stage.finish(items, config=config, tokenizer_dirs=d.tokenizer_dirs(), documents=documents)
        return written["doc"]


def _cap_description(ctx: RouteContext) -> str:
    ranks = sorted(set(ctx.input_ranks.values()))
    if not ranks:
        return "the rank limit"
    r = str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"
    return f"the largest input rank of each module ({r})"
