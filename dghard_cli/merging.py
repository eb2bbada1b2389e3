"""``dghard merge``: combine one or more fine-tunes of the same base.

Methods (Δ_i = W_i − W_base, formed in float32 or wider; the result is cast once):

- ``wise-ft``          W = (1−α)·W_base + α·W_ft                      (exactly one fine-tune)
- ``task-arithmetic``  W = W_base + λ·Σ w_i·Δ_i
- ``ties``             W = W_base + λ·disjoint_mean_w(elect_w(trim_density(Δ_i)))
- ``dare-linear``      W = W_base + λ·Σ w_i·DARE_density,seed(Δ_i)   (``dare`` is the same)
- ``dare-ties``        W = W_base + λ·disjoint_mean_w(elect_w(DARE_density,seed(Δ_i)))
- ``recall``           W_l = W_base,l + Σ_i α_{l,i}·Δ_{l,i}, α from hidden-state similarity
- ``dg-hard``          W = W_base + λ·Σ w_i·Δ_i*, Δ_i* = DG-Hard(Δ_i) on eligible matrices
- ``slerp``, ``breadcrumbs``, ``breadcrumbs-ties``, ``della``, ``della-linear``, ``model-stock``:
  see their modules in :mod:`dghard_cli.methods` (mergekit 0.1.5's definitions)

Elementwise methods apply to every floating tensor present with equal shape in BASE and all
fine-tunes (norms and biases too); dg-hard filters the eligible matrices (repair's rule:
2-D, ≥ ``--min-numel``) and uses task arithmetic on the rest. Excluded, non-floating and
fine-tune-only tensors keep the first fine-tune's value.

Every method takes a layer-strength schedule (``schedule``: ``--lines A,B`` or
``--layer-strengths``), applied to the merged task vector: W = W_base + λ(ℓ)·τ_merged.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

from dghard_cli.architecture import VOCAB_EMBEDDING
from dghard_cli.engine.device import resolve_device
from dghard_cli.engine.plan import Eligibility, PolicyOptions, build_plan
from dghard_cli.engine.writer import OutputTarget, RunOptions, WriteRequest
from dghard_cli.errors import InputError
from dghard_cli.io.checkpoint import Checkpoint
from dghard_cli.io.hub import open_checkpoint
from dghard_cli.io.safetensors_format import FLOAT_DTYPES
from dghard_cli.lora.output import AdapterOutput, LoraOutputOptions
from dghard_cli.lora.source import open_ft
from dghard_cli.methods import registry
from dghard_cli.methods.calibration import RecallOptions, recall_weights
from dghard_cli.methods.merge_ops import WHOLE_BYTES
from dghard_cli.methods.per_tensor import PerTensorOp, TensorParameterSource, tensor_parameter_sets
from dghard_cli.numbers import flag_value
from dghard_cli.repairing import output_flags
from dghard_cli.schedule.bind import bind as bind_schedule
from dghard_cli.schedule.op import wrap as wrap_scheduled
from dghard_cli.schedule.spec import LayerSchedule


@dataclass
class MergeOptions:
    """What to merge how. ``None`` means: the method's default (or: not given).

    The parameter fields are those of the built-in methods (see
    :mod:`dghard_cli.methods.registry`); a parameter declared by an added method is given in
    ``extra`` under its name.
    """

    method: str = "task-arithmetic"
    alpha: float | None = None
    weights: list[float] | None = None
    lam: float | None = None
    density: float | list[float | None] | None = None  # one value, or one per fine-tune (None: default)
    seed: int | None = None
    scale: float | None = None
    calib: Path | None = None
    recall: RecallOptions | None = None
    extra: dict = field(default_factory=dict)
    policy: PolicyOptions = field(default_factory=PolicyOptions)
    run: RunOptions = field(default_factory=RunOptions)
    base_revision: str | None = None
    ft_revisions: list[str | None] | None = None
    block_bytes: int = 64 * 1024 * 1024  # row blocks of large tensors (work copies of all inputs)
    whole_bytes: int = WHOLE_BYTES  # TIES: whole tensors up to this size (all work copies)
    create_parents: bool = False  # make OUT's missing parent directories (a recipe's ``out``)
    schedule: LayerSchedule | None = None  # --lines / --layer-strengths (registry.COMMON)
    #: parameters that vary by tensor (a mergekit recipe's gradients/filters): ``(name, layers) ->
    #: parameter values by name``, see :mod:`dghard_cli.methods.per_tensor`
    tensor_parameters: TensorParameterSource | None = None
    lora: LoraOutputOptions = field(default_factory=LoraOutputOptions)  # --format/--merge/--rank
    #: ``base``: a mergekit recipe's ``tokenizer_source: base``, a no-op when every model shares
    #: BASE's vocabulary (checked; refused otherwise)
    tokenizer_source: str | None = None


def merge_argv(base: str, fts: list[str], out: str, opts: MergeOptions) -> list[str]:
    """The ``dghard merge`` command line that runs ``merge(base, fts, out, opts)``: the method,
    every parameter given (the registry's order), the schedule, ``--dtype``, ``--merge`` and
    ``--device`` (what a sweep candidate sets; the other options at their defaults). Parsing it
    gives ``opts`` back (tests/test_sweep_families.py)."""
    argv = ["dghard", "merge", "--method", opts.method]
    for q in registry.carried_params():
        v = registry.given_value(opts, q)
        if v is not None:
            argv += [q.cli_flag, flag_value(v) if q.scalar else str(v)]
    if opts.schedule is not None:
        argv += opts.schedule.argv()
    return argv + [base, *fts, "--out", out] + output_flags(opts.policy, opts.lora, opts.run)


def vocabulary_size(ck: Checkpoint) -> int | None:
    """The token-embedding rows of a checkpoint (None: no token embedding found)."""
    for name, info in ck.tensors.items():
        if VOCAB_EMBEDDING.search(name) and len(info.shape) == 2:
            return int(info.shape[0])
    return None


def check_shared_vocabulary(base: Checkpoint, fts: list[Checkpoint], where: str) -> str:
    """``tokenizer_source: base`` is a no-op when every fine-tune has BASE's vocabulary (as
    many token-embedding rows); the note the report carries, or InputError (one line)."""
    n_base = vocabulary_size(base)
    for i, ft in enumerate(fts, 1):
        n = vocabulary_size(ft)
        if n != n_base:
            raise InputError(
                f"{where}: FT #{i} ({ft.source}) has {n} tokens, BASE {n_base}: taking BASE's tokenizer "
                "would need tokenizer surgery, which dghard does not do; remove 'tokenizer_source'"
            )
    return f"base: every model has BASE's vocabulary ({n_base} tokens), so BASE's tokenizer is FT #1's"


def varying_parameters(sets: dict[str, tuple[dict, dict]]) -> list[str]:
    """The parameters whose value is not the same for every tensor (a recipe's gradients and
    filters): the report's ``parameters`` holds one tensor's value of them, not the recipe's."""
    seen: dict[str, set[str]] = {}
    for p, _ in sets.values():
        for k, v in p.items():
            seen.setdefault(k, set()).add(repr(v))
    return sorted(k for k, vs in seen.items() if len(vs) > 1)


def canonical_method(method: str) -> str:
    return registry.get_method(method).name


def resolve_parameters(opts: MergeOptions, n_fts: int) -> dict:
    """The effective method parameters (defaults filled in), validated; InputError otherwise."""
    return registry.resolve(opts, n_fts)


def merge_eligibility(policy: PolicyOptions) -> Eligibility:
    """Elementwise merges: every selected floating tensor (1-D norms and biases too)."""

    def eligible(name: str, info) -> str | None:
        if not policy.selected(name):
            return "excluded"
        if info.dtype not in FLOAT_DTYPES:
            return "non-float"
        return None

    return eligible


def policy_parameters(policy: PolicyOptions) -> dict:
    return {
        "min_numel": policy.min_numel,
        "include": list(policy.include),
        "exclude": list(policy.exclude),
        "allow_missing": policy.allow_missing,
        "dtype": policy.out_dtype,
        "shard_size": policy.shard_size,
    }


def _check_dtypes(fts: list[Checkpoint]) -> None:
    first = fts[0]
    for k, other in enumerate(fts[1:], start=2):
        for name, info in first.tensors.items():
            o = other.tensors[name]
            if (info.dtype in FLOAT_DTYPES) != (o.dtype in FLOAT_DTYPES):
                raise InputError(
                    f"fine-tune #{k} ({other.source}) stores tensor {name!r} as {o.dtype} but #1 "
                    f"({first.source}) as {info.dtype}; merged models must share one architecture"
                )


def _make_op(method: str, p: dict, opts: MergeOptions, recall_w, device):
    return registry.methods()[method].make_op(p, registry.BuildContext(opts, device, recall_w))


def _computed_jobs(plan, fts: list[Checkpoint], output: AdapterOutput) -> list:
    """The jobs whose full tensors the run computes, for the checks made before writing: an
    adapter output skips the tensors no adapter touches, and ``--core-space`` merges the LoRA
    modules on their small cores."""
    if output.format != "peft":
        return plan.jobs
    jobs = [j for j in plan.jobs if not j.untouched]
    if output.core_kind is not None:
        modules = {m for f in fts for m in getattr(f, "modules", {})}
        jobs = [j for j in jobs if not (j.name.endswith(".weight") and j.name[: -len(".weight")] in modules)]
    return jobs


def _core_route(kind: str, opts: MergeOptions, op_maker) -> dict:
    """``--core-space``: the method's operation for cores, and which modules it merges.

    A core is at most Σ r_i wide, so the method is built with no ``--min-numel`` floor; a
    "lossless" method takes the modules its matrix rule treats as matrices on the full tensors
    (the rest, which it averages, are merged on the full tensors by the factored route, exactly as
    without --core-space), a "cores" (elementwise) method every LoRA module."""
    from dghard_cli.methods.subspace import matrix_rule

    core_opts = dataclasses.replace(opts, policy=dataclasses.replace(opts.policy, min_numel=0))
    rule = matrix_rule(opts.policy) if kind == "lossless" else (lambda job: True)
    return {"make_core_op": op_maker(core_opts), "core_rule": rule}


def merge(
    base: str | Path,
    fts: list[str | Path],
    out: str | Path,
    options: MergeOptions | None = None,
) -> dict:
    """Merge the fine-tunes ``fts`` of ``base`` into ``out``; returns the report (also in OUT).

    With ``options.run.dry_run`` nothing is written (and RECALL runs no model).

    Example::

        from dghard_cli import MergeOptions, merge
        doc = merge("base/", ["ft_a/", "ft_b/"], "merged/", MergeOptions(method="ties", density=0.2))
        print(doc["merge"]["kept_fraction"])
    """
    opts = options or MergeOptions()
    t0 = time.perf_counter()
    method = canonical_method(opts.method)
    p = resolve_parameters(opts, len(fts))
    if "svc_alpha" in p and "calibrate" not in p:
        raise InputError("--svc-alpha sets SVC's floor: it applies with --calibrate svc")
    if "calibrate" in p and len(fts) < 2:
        # one task vector: s_r = the merge's own strength, and γ = 1/max(α, s) undoes it
        raise InputError(
            "--calibrate svc compares the merge with several task vectors: with one fine-tune it would "
            "undo the merge's strength; merge two or more fine-tunes, or leave --calibrate out"
        )
    revs = opts.ft_revisions or [None] * len(fts)
    opened: list[Checkpoint] = []
    try:
        base_ck = open_checkpoint(str(base), revision=opts.base_revision, label="BASE")
        opened.append(base_ck)
        ft_cks = []
        for k, (ft, rev) in enumerate(zip(fts, revs, strict=True), start=1):
            label = "FT" if len(fts) == 1 else f"FT #{k}"
            ck = open_ft(str(ft), base=base_ck, revision=rev, label=label)
            opened.append(ck)
            ft_cks.append(ck)
        core_kind = registry.methods()[method].core_space
        if opts.lora.core_space and core_kind is None:
            takers = ", ".join(n for n, m in registry.methods().items() if m.core_space)
            raise InputError(
                f"--core-space: --method {method} cannot run on the adapters' cores (it reads BASE's weights "
                f"or depends on the full matrix's size); --core-space takes {takers}"
            )
        output = AdapterOutput(
            opts.lora,
            base_ck,
            ft_cks,
            command="merge",
            method=method,
            params=p,
            out_dtype=opts.policy.out_dtype,
            core_kind=core_kind,
        )
        if output.format == "peft" and "calibrate" in p and output.core_kind is None:
            raise InputError(
                "--calibrate svc rescales the merged update's singular values, which the adapter routes "
                "do not compute: write a full checkpoint (--format full)"
            )
        plan = build_plan(base_ck, ft_cks, opts.policy, eligible=merge_eligibility(opts.policy))
        computed = _computed_jobs(plan, ft_cks, output)
        if "calibrate" in p:  # SVC's Gram route: refused before anything is written if it cannot fit
            from dghard_cli.engine.working_memory import check_dense_svd
            from dghard_cli.methods.subspace import matrix_rule
            from dghard_cli.methods.svc import svc_bytes

            check_dense_svd(
                computed,
                n_fts=len(ft_cks),
                is_matrix=matrix_rule(opts.policy),
                what="--calibrate svc",
                device=resolve_device(opts.run.device),
                bytes_of=svc_bytes,
                work="each merged matrix held in float64, with its Gram matrices",
            )
        check_plan = registry.methods()[method].check_plan
        if check_plan is not None:
            check_plan(p, computed, len(ft_cks), opts.policy, resolve_device(opts.run.device))
        _check_dtypes(ft_cks)
        strengths = bind_schedule(opts.schedule, plan, ft_cks[0]) if opts.schedule is not None else None
        timings = {"plan": time.perf_counter() - t0}
        recall_w = None
        target = None  # OUT, once checked
        extra: dict = {}
        if opts.create_parents and not opts.run.dry_run:
            Path(out).expanduser().absolute().parent.mkdir(parents=True, exist_ok=True)
        if registry.methods()[method].calibrates and not opts.run.dry_run:
            # OUT checked before minutes of forward passes (the writer does not check it again)
            target = OutputTarget.check(Path(out), opts.run, base_ck, ft_cks)
            t1 = time.perf_counter()
            recall_w = recall_weights(
                base_ck, ft_cks, opts.recall or RecallOptions(), opts.calib, resolve_device(opts.run.device)
            )
            timings["calibration"] = time.perf_counter() - t1
            extra["recall"] = recall_w.report()
        parameters = {**p, **policy_parameters(opts.policy)}
        if opts.tokenizer_source is not None:
            parameters["tokenizer_source"] = check_shared_vocabulary(base_ck, ft_cks, "tokenizer_source")
        sets = None
        if opts.tensor_parameters is not None:  # validated for every tensor before anything is written
            sets = tensor_parameter_sets(plan, opts, len(fts), resolve_parameters)
            parameters["per_tensor"] = "varies by tensor (the recipe's gradients/filters): see each tensor"
            parameters["varies_per_tensor"] = varying_parameters(sets)

        def op_maker(o: MergeOptions):
            def make_op(device):
                if sets is None:
                    return _make_op(method, p, o, recall_w, device)
                return PerTensorOp(sets, lambda q: _make_op(method, q, o, recall_w, device))

            if p.get("calibrate") == "svc":  # before the schedule: W_base + λ(ℓ)·ΔW_svc
                from dghard_cli.methods import svc
                from dghard_cli.methods.subspace import matrix_rule

                make_op = svc.wrap(
                    make_op, p.get("svc_alpha", svc.SVC_ALPHA), matrix_rule(o.policy), o.block_bytes
                )
            return wrap_scheduled(make_op) if strengths is not None else make_op

        make_op = op_maker(opts)
        if strengths is not None:
            extra["layer_strengths"] = strengths.report()

        def extra_report(records: list[dict]) -> dict:
            out = {**extra, "merge": registry.summary(method, records, p)}
            if p.get("calibrate") == "svc":
                from dghard_cli.methods import svc

                out["svc"] = {"alpha": p.get("svc_alpha", svc.SVC_ALPHA), **svc.summary(records)}
            return out

        request = WriteRequest(
            command="merge",
            method=method,
            parameters=parameters,
            base=base_ck,
            fts=ft_cks,
            out=Path(out),
            plan=plan,
            make_op=make_op,
            run=opts.run,
            spectral=False,
            extra_report=extra_report,
            timings=timings,
            strengths=strengths,
            target=target,
        )
        core = _core_route(output.core_kind, opts, op_maker) if output.core_kind is not None else {}
        return output.write(request, **core)
    finally:
        for ck in opened:
            ck.close()
