"""``dghard merge``: combine one or more fine-tunes of the same base.

Methods (Δ_i = W_i − W_base, formed in float32 or wider; the result is cast once):

- ``wise-ft``          W = (1−α)·W_base + α·W_ft                      (exactly one fine-tune)
- ``task-arithmetic``  W = W_base + λ·Σ w_i·Δ_i
- ``ties``             W = W_base + λ·disjoint_mean_w(elect_w(trim_density(Δ_i)))
- ``dare-linear``      W = W_base + λ·Σ w_i·DARE_density,seed(Δ_i)   (``dare`` is the same)
- ``dare-ties``        W = W_base + λ·disjoint_mean_w(elect_w(DARE_density,seed(Δ_i)))
- ``recall``           W_l = W_base,l + Σ_i α_{l,i}·Δ_{l,i}, α from hidden-state similarity
- ``dg-hard``          W = W_base + λ·Σ w_i·Δ_i*, Δ_i* = DG-Hard(Δ_i) on eligible matrices

Elementwise methods apply to every floating tensor present with equal shape in BASE and all
fine-tunes (norms and biases too); dg-hard filters the eligible matrices (repair's rule:
2-D, ≥ ``--min-numel``) and uses task arithmetic on the rest. Excluded, non-floating and
fine-tune-only tensors keep the first fine-tune's value.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from dghard_cli.engine.adapter_run import AdapterOutput, LoraOutputOptions
from dghard_cli.engine.device import resolve_device
from dghard_cli.engine.plan import Eligibility, PolicyOptions, build_plan, matrix_eligibility
from dghard_cli.engine.runner import RunOptions, write_model
from dghard_cli.errors import InputError
from dghard_cli.io.adapter_source import open_ft
from dghard_cli.io.checkpoint import Checkpoint
from dghard_cli.io.hub import open_checkpoint
from dghard_cli.io.output import check_out_path
from dghard_cli.io.safetensors_format import FLOAT_DTYPES
from dghard_cli.methods.calibration import RecallOptions, recall_weights
from dghard_cli.methods.dare import CHUNK
from dghard_cli.methods.merge_ops import (
    WHOLE_BYTES,
    DareKernel,
    ElementwiseMergeOp,
    LayerWeightsKernel,
    SpectralMergeOp,
    TaskArithmeticKernel,
    TiesKernel,
    WiseFTKernel,
    merged_numel,
)
from dghard_cli.spectral.spectrum import ROUTE, ShrinkSpec

METHODS = ("wise-ft", "task-arithmetic", "ties", "dare", "dare-linear", "dare-ties", "recall", "dg-hard")
ALIASES = {"dare": "dare-linear"}

#: Which method parameters each method takes (anything else given is an error).
APPLIES: dict[str, set[str]] = {
    "wise-ft": {"alpha"},
    "task-arithmetic": {"weights", "lambda"},
    "ties": {"weights", "lambda", "density"},
    "dare-linear": {"weights", "lambda", "density", "seed"},
    "dare-ties": {"weights", "lambda", "density", "seed"},
    "recall": {"calib", "recall"},
    "dg-hard": {"weights", "lambda", "scale"},
}

DEFAULTS = {"alpha": 0.5, "lambda": 1.0, "seed": 0, "scale": 1.0}
DEFAULT_DENSITY = {"ties": 0.2, "dare-linear": 0.5, "dare-ties": 0.5}


@dataclass
class MergeOptions:
    """What to merge how. ``None`` means: the method's default (or: not given)."""

    method: str = "task-arithmetic"
    alpha: float | None = None
    weights: list[float] | None = None
    lam: float | None = None
    density: float | None = None
    seed: int | None = None
    scale: float | None = None
    calib: Path | None = None
    recall: RecallOptions | None = None
    policy: PolicyOptions = field(default_factory=PolicyOptions)
    run: RunOptions = field(default_factory=RunOptions)
    base_revision: str | None = None
    ft_revisions: list[str | None] | None = None
    block_bytes: int = 64 * 1024 * 1024  # row blocks of large tensors (work copies of all inputs)
    whole_bytes: int = WHOLE_BYTES  # TIES: whole tensors up to this size (all work copies)
    create_parents: bool = False  # make OUT's missing parent directories (a recipe's ``out``)
    lora: LoraOutputOptions = field(default_factory=LoraOutputOptions)  # --format/--merge/--rank


def canonical_method(method: str) -> str:
    m = (method or "").strip().lower()
    if m not in METHODS:
        raise InputError(f"--method {method!r} is not one of {', '.join(METHODS)}")
    return ALIASES.get(m, m)


def _finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"--{name} must be a finite number, got {value!r}")
    return float(value)


def resolve_parameters(opts: MergeOptions, n_fts: int) -> dict:
    """The effective method parameters (defaults filled in), validated; InputError otherwise."""
    method = canonical_method(opts.method)
    given = {
        "alpha": opts.alpha,
        "weights": opts.weights,
        "lambda": opts.lam,
        "density": opts.density,
        "seed": opts.seed,
        "scale": opts.scale,
        "calib": opts.calib,
        "recall": opts.recall,
    }
    for key, value in given.items():
        if value is not None and key not in APPLIES[method]:
            flag = "--recall-*" if key == "recall" else f"--{key}"
            raise InputError(f"{flag} does not apply to --method {method} (it takes: {_takes(method)})")
    if n_fts < 1:
        raise InputError("merge needs at least one fine-tuned checkpoint after BASE")
    if method == "wise-ft" and n_fts != 1:
        raise InputError(f"--method wise-ft interpolates BASE and one fine-tune; got {n_fts} fine-tunes")
    p: dict = {"method": method}
    if "alpha" in APPLIES[method]:
        a = _finite("alpha", DEFAULTS["alpha"] if opts.alpha is None else opts.alpha)
        if not 0.0 <= a <= 1.0:
            raise InputError(f"--alpha must be in [0, 1] (0 = BASE, 1 = the fine-tune), got {a}")
        p["alpha"] = a
    if "weights" in APPLIES[method]:
        w = [1.0] * n_fts if opts.weights is None else [_finite("weights", x) for x in opts.weights]
        if len(w) != n_fts:
            raise InputError(f"--weights has {len(w)} value(s) but {n_fts} fine-tune(s) were given")
        if method in ("ties", "dare-ties"):
            if any(x < 0 for x in w):
                raise InputError(
                    f"--method {method} takes weights >= 0 (a disjoint mean with negative weights is "
                    "not a mean); to subtract a task vector use task-arithmetic or dare-linear"
                )
            if not any(x > 0 for x in w):
                raise InputError(f"--method {method}: at least one weight must be > 0")
        p["weights"] = w
    if "lambda" in APPLIES[method]:
        p["lambda"] = _finite("lambda", DEFAULTS["lambda"] if opts.lam is None else opts.lam)
    if "density" in APPLIES[method]:
        d = _finite("density", DEFAULT_DENSITY[method] if opts.density is None else opts.density)
        if not 0.0 < d <= 1.0:
            raise InputError(f"--density is the fraction of each delta kept and must be in (0, 1], got {d}")
        p["density"] = d
    if "seed" in APPLIES[method]:
        s = DEFAULTS["seed"] if opts.seed is None else opts.seed
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise InputError(f"--seed must be an integer >= 0, got {s!r}")
        p["seed"] = s
        p["random_stream"] = (
            f"torch.Generator(CPU) per {CHUNK}-entry chunk, seeded by BLAKE2b(seed, name, index, chunk)"
        )
    if "scale" in APPLIES[method]:
        sc = _finite("scale", DEFAULTS["scale"] if opts.scale is None else opts.scale)
        p.update(ShrinkSpec(scale=sc).describe())
        p["route"] = ROUTE
    if method == "recall":
        p.update((opts.recall or RecallOptions()).describe())
        p["calib"] = str(opts.calib) if opts.calib is not None else None
    return p


def _takes(method: str) -> str:
    names = sorted(APPLIES[method])
    return ", ".join("--recall-* options" if n == "recall" else f"--{n}" for n in names)


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
    bb = opts.block_bytes
    if method == "wise-ft":
        return ElementwiseMergeOp(lambda job: WiseFTKernel(p["alpha"]), device, bb)
    if method == "task-arithmetic":
        return ElementwiseMergeOp(lambda job: TaskArithmeticKernel(p["weights"], p["lambda"]), device, bb)
    if method == "ties":
        return ElementwiseMergeOp(
            lambda job: TiesKernel(p["weights"], p["lambda"], p["density"], merged_numel(job)),
            device,
            bb,
            opts.whole_bytes,
        )
    if method in ("dare-linear", "dare-ties"):
        return ElementwiseMergeOp(
            lambda job: DareKernel(
                p["weights"],
                p["lambda"],
                p["density"],
                p["seed"],
                job.name,
                merged_numel(job),
                ties=method == "dare-ties",
            ),
            device,
            bb,
        )
    if method == "recall":
        return ElementwiseMergeOp(lambda job: LayerWeightsKernel(*recall_w.for_tensor(job.name)), device, bb)
    if method == "dg-hard":
        matrix = matrix_eligibility(opts.policy)

        def is_matrix(job) -> bool:
            rows = job.shared_rows if job.shared_rows is not None else (job.shape[0] if job.shape else 0)
            return (
                len(job.shape) == 2
                and rows >= 2
                and rows * job.shape[1] >= opts.policy.min_numel
                and matrix(job.name, job.fts[0]) is None
            )

        spec = ShrinkSpec(scale=p["scale"])
        return SpectralMergeOp(spec, p["weights"], p["lambda"], device, is_matrix, bb)
    raise AssertionError(method)


def _summary(method: str, records: list[dict], p: dict) -> dict:
    """Method-level totals for the report (``merge`` section)."""
    rows = [r for r in records if r["action"] in ("method", "resized")]
    out: dict = {"method_tensors": len(rows)}
    if method in ("ties", "dare-linear", "dare-ties"):
        numel = [_merged_entries(r) for r in rows]
        n_fts = len(p["weights"])
        kept = [sum(r["kept"][i] for r in rows) for i in range(n_fts)]
        total = sum(numel)
        out["kept_fraction"] = [k / total if total else 0.0 for k in kept]
        out["entries"] = total
        if method != "dare-linear":
            conflicts = sum(r.get("sign_conflicts", 0) for r in rows)
            out["sign_conflicts"] = conflicts
            out["sign_conflict_fraction"] = conflicts / total if total else 0.0
    if method == "dg-hard":
        spectral = [r for r in rows if r.get("merge_rule") == "dg-hard"]
        out["filtered_matrices"] = len(spectral)
        out["task_arithmetic_tensors"] = len(rows) - len(spectral)
        if spectral:
            n_fts = len(p["weights"])
            out["median_rank_kept"] = [
                statistics.median(r["ranks"][i] for r in spectral) for i in range(n_fts)
            ]
    return out


def _merged_entries(rec: dict) -> int:
    shape = rec["shape"]
    if len(shape) >= 2 and rec.get("shared_rows") is not None:
        return rec["shared_rows"] * math.prod(shape[1:])
    return math.prod(shape)


def merge(
    base: str | Path,
    fts: list[str | Path],
    out: str | Path,
    options: MergeOptions | None = None,
) -> dict:
    """Merge the fine-tunes ``fts`` of ``base`` into ``out``; returns the report (also in OUT).

    With ``options.run.dry_run`` nothing is written (and RECALL runs no model).
    """
    opts = options or MergeOptions()
    t0 = time.perf_counter()
    method = canonical_method(opts.method)
    p = resolve_parameters(opts, len(fts))
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
        output = AdapterOutput(
            opts.lora,
            base_ck,
            ft_cks,
            command="merge",
            method=method,
            params=p,
            out_dtype=opts.policy.out_dtype,
        )
        plan = build_plan(base_ck, ft_cks, opts.policy, eligible=merge_eligibility(opts.policy))
        _check_dtypes(ft_cks)
        timings = {"plan": time.perf_counter() - t0}
        recall_w = None
        extra: dict = {}
        if opts.create_parents and not opts.run.dry_run:
            Path(out).expanduser().absolute().parent.mkdir(parents=True, exist_ok=True)
        if method == "recall" and not opts.run.dry_run:
            # refuse a bad OUT before minutes of forward passes (write_model checks it again)
            check_out_path(Path(out), [base_ck.path, *[f.path for f in ft_cks]], overwrite=opts.run.overwrite)
            t1 = time.perf_counter()
            recall_w = recall_weights(
                base_ck, ft_cks, opts.recall or RecallOptions(), opts.calib, resolve_device(opts.run.device)
            )
            timings["calibration"] = time.perf_counter() - t1
            extra["recall"] = recall_w.report()
        parameters = {**p, **policy_parameters(opts.policy)}
        if output.format == "peft":
            if opts.create_parents and not opts.run.dry_run:
                Path(out).expanduser().absolute().parent.mkdir(parents=True, exist_ok=True)
            return output.write(
                out=Path(out),
                plan=plan,
                make_op=lambda device: _make_op(method, p, opts, None, device),
                run=opts.run,
                parameters=parameters,
            )
        parameters.update(output.full_parameters())

        def extra_report() -> dict:
            return extra

        doc = write_model(
            command="merge",
            method=method,
            parameters=parameters,
            base=base_ck,
            fts=ft_cks,
            out=Path(out),
            plan=plan,
            make_op=lambda device: _make_op(method, p, opts, recall_w, device),
            run=opts.run,
            spectral=False,
            extra_report=extra_report,
            timings=timings,
        )
        if not opts.run.dry_run:
            doc["merge"] = _summary(method, doc["tensors"], p)
            if "calibration" in timings:
                doc["timings"]["total"] = round(doc["timings"]["total"] + timings["calibration"], 3)
            _rewrite_report(doc, opts.run, Path(out))
        return doc
    finally:
        for ck in opened:
            ck.close()


def _rewrite_report(doc: dict, run: RunOptions, out: Path) -> None:
    """Add the method summary to the written report (the runner wrote it before we had it)."""
    import json

    from dghard_cli.engine.runner import REPORT_NAME

    target = Path(run.report_path) if run.report_path is not None else out / REPORT_NAME
    if target.exists():
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        tmp.replace(target)
