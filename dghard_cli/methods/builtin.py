"""The built-in merge methods and their parameters, declared with :mod:`.declare`: WiSE-FT,
task arithmetic, TIES, DARE (linear and TIES), RECALL, DG-Hard. The order of
:data:`BUILTIN_PARAMS` is the order every surface lists them in (options, recipe keys, the
reproduction command)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

from dghard_cli.errors import InputError
from dghard_cli.methods import recall as R
from dghard_cli.methods.declare import (
    BOOL,
    INT,
    MAPPING,
    NUMBER,
    PATH,
    WEIGHTS,
    BuildContext,
    MergeMethod,
    Param,
    SubOption,
    boolean,
    finite,
    in_range,
)


def _any_finite(name: str) -> Callable[[Any, MergeMethod, int], float]:
    return lambda value, method, n_fts: finite(name, value)


def _check_alpha(value: Any, method: MergeMethod, n_fts: int) -> float:
    if method.name != "wise-ft":  # tsv, iso-c, iso-cts, star, wudi: the scale of the merged update
        return in_range(0.0, math.inf, "alpha")(value, method, n_fts)
    return in_range(0.0, 1.0, "alpha", " (0 = BASE, 1 = the fine-tune)")(value, method, n_fts)


def _check_weights(value: Any, method: MergeMethod, n_fts: int) -> list[float]:
    w = [1.0] * n_fts if value is None else [finite("weights", x) for x in value]
    if len(w) != n_fts:
        raise InputError(f"--weights has {len(w)} value(s) but {n_fts} fine-tune(s) were given")
    if method.check_weights is not None:
        method.check_weights(method.name, w)
    return w


def _check_density(value: Any, method: MergeMethod, n_fts: int) -> float | list[float]:
    """One density, or one per fine-tune (a mergekit recipe's per-model densities; None: the
    method's default); a list of equal values is that value."""
    default = method.defaults.get("density", _DENSITY_DEFAULT.get(method.name))
    values = value if isinstance(value, (list, tuple)) else [value]
    ds = [default if x is None else finite("density", x) for x in values]
    if isinstance(value, (list, tuple)) and len(ds) != n_fts:
        raise InputError(f"--density has {len(ds)} value(s) but {n_fts} fine-tune(s) were given")
    for d in ds:
        if not 0.0 < d <= 1.0:
            raise InputError(f"--density is the fraction of each delta kept and must be in (0, 1], got {d}")
    return ds[0] if all(d == ds[0] for d in ds) else ds


def _check_seed(value: Any, method: MergeMethod, n_fts: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InputError(f"--seed must be an integer >= 0, got {value!r}")
    return value


def nonnegative_weights(method: str, w: list[float]) -> None:
    """A disjoint mean (TIES' election) needs weights >= 0, one of them > 0."""
    if any(x < 0 for x in w):
        raise InputError(
            f"--method {method} takes weights >= 0 (a disjoint mean with negative weights is "
            "not a mean); to subtract a task vector use task-arithmetic or dare-linear"
        )
    if not any(x > 0 for x in w):
        raise InputError(f"--method {method}: at least one weight must be > 0")


def _describe_seed(seed: int) -> dict:
    from dghard_cli.methods.dare import CHUNK

    return {
        "seed": seed,
        "random_stream": f"torch.Generator(CPU) per {CHUNK}-entry chunk, seeded by BLAKE2b(seed, name, index, chunk)",
    }


def _describe_scale(scale: float) -> dict:
    from dghard_cli.spectral.spectrum import ROUTE, ShrinkSpec

    return {**ShrinkSpec(scale=scale).describe(), "route": ROUTE}


def _describe_recall(value: Any) -> dict:
    from dghard_cli.methods.calibration import RecallOptions

    return (value or RecallOptions()).describe()


def _build_recall(cfg: dict) -> Any:
    from dghard_cli.methods.calibration import RecallOptions

    return RecallOptions(**cfg)


def _describe_calib(value: Any) -> dict:
    return {"calib": str(value) if value is not None else None}


_SCALE_RANGE = (0.25, 16.0)
_DENSITY_DEFAULT = {"ties": 0.2, "dare-linear": 0.5, "dare-ties": 0.5}


_LAMBDA_RANGE = (0.0, 2.0)


BUILTIN_PARAMS: tuple[Param, ...] = (
    Param(
        "alpha",
        NUMBER,
        "wise-ft: the fine-tune's weight, 0..1 (default 0.5); others: the merged update's scale, >= 0 "
        "(default 1).",
        default=0.5,
        check=_check_alpha,
        attr="alpha",
        sweep_range=(0.0, 1.0),
    ),
    Param(
        "weights",
        WEIGHTS,
        "One weight per fine-tune, comma-separated, e.g. 1,0.5 (default 1 each).",
        check=_check_weights,
        attr="weights",
        recipe=False,
    ),
    Param(
        "lambda",
        NUMBER,
        "Scales the merged delta (default 1; cart: its centred low-rank parts, default 2).",
        default=1.0,
        check=_any_finite("lambda"),
        attr="lam",
        sweep_range=_LAMBDA_RANGE,
    ),
    Param(
        "density",
        NUMBER,
        "ties/dare: fraction of each delta kept (default ties 0.2, dare 0.5).",
        default=_DENSITY_DEFAULT,
        check=_check_density,
        attr="density",
        sweep_range=(0.01, 1.0),
        sweep_log=True,
    ),
    Param(
        "seed",
        INT,
        "dare: seed of the random drop (default 0).",
        default=0,
        check=_check_seed,
        attr="seed",
        describe=_describe_seed,
    ),
    Param(
        "scale",
        NUMBER,
        "dg-hard: multiplies the Gavish–Donoho threshold (default 1).",
        default=1.0,
        check=_any_finite("scale"),
        attr="scale",
        describe=_describe_scale,
        sweep_range=_SCALE_RANGE,
        sweep_log=True,
    ),
    Param(
        "calib",
        PATH,
        "recall: calibration text (.txt, samples split by blank lines) or .jsonl.",
        attr="calib",
        describe=_describe_calib,
    ),
    Param(
        "recall",
        MAPPING,
        "RECALL options",
        attr="recall",
        describe=_describe_recall,
        build=_build_recall,
        sub=(
            SubOption("kernel", "string", "recall: linear-cka (default), rbf-cka or cosine.", R.KERNELS),
            SubOption(
                "pooling",
                "string",
                "recall: token (every token a row; default) or mean (one row per sample).",
                R.POOLINGS,
            ),
            SubOption("temperature", NUMBER, "recall: softmax temperature (default 0.05)."),
            SubOption("samples", INT, "recall: number of typical samples (default 8)."),
            SubOption(
                "select", "string", "recall: kmeans (typical samples; default) or first.", R.SELECTIONS
            ),
            SubOption("max_tokens", INT, "recall: tokens per sample (default 64)."),
        ),
    ),
    Param(
        "normalize",
        BOOL,
        "ties, dare-ties, breadcrumbs-ties, della: disjoint mean (normalize) or sum "
        "(default: mean, breadcrumbs-ties: sum — mergekit's defaults).",
        default=True,
        check=boolean("normalize"),
    ),
)


def _wise_ft_op(p: dict, ctx: BuildContext):
    from dghard_cli.methods.merge_ops import ElementwiseMergeOp, WiseFTKernel

    return ElementwiseMergeOp(lambda job: WiseFTKernel(p["alpha"]), ctx.device, ctx.block_bytes)


def _task_arithmetic_op(p: dict, ctx: BuildContext):
    from dghard_cli.methods.merge_ops import ElementwiseMergeOp, TaskArithmeticKernel

    return ElementwiseMergeOp(
        lambda job: TaskArithmeticKernel(p["weights"], p["lambda"]), ctx.device, ctx.block_bytes
    )


def _ties_op(p: dict, ctx: BuildContext):
    from dghard_cli.methods.merge_ops import ElementwiseMergeOp, TiesKernel, merged_numel

    return ElementwiseMergeOp(
        lambda job: TiesKernel(
            p["weights"], p["lambda"], p["density"], merged_numel(job), normalize=p["normalize"]
        ),
        ctx.device,
        ctx.block_bytes,
        ctx.options.whole_bytes,
    )


def _dare_op(ties: bool) -> Callable[[dict, BuildContext], Any]:
    def make(p: dict, ctx: BuildContext):
        from dghard_cli.methods.merge_ops import DareKernel, ElementwiseMergeOp, merged_numel

        return ElementwiseMergeOp(
            lambda job: DareKernel(
                p["weights"],
                p["lambda"],
                p["density"],
                p["seed"],
                job.name,
                merged_numel(job),
                ties=ties,
                normalize=p.get("normalize", True),  # dare-linear: no election
            ),
            ctx.device,
            ctx.block_bytes,
        )

    return make


def _recall_op(p: dict, ctx: BuildContext):
    from dghard_cli.methods.merge_ops import ElementwiseMergeOp, LayerWeightsKernel

    w = ctx.recall_weights
    return ElementwiseMergeOp(
        lambda job: LayerWeightsKernel(*w.for_tensor(job.name)), ctx.device, ctx.block_bytes
    )


def _dg_hard_op(p: dict, ctx: BuildContext):
    from dghard_cli.engine.plan import matrix_eligibility
    from dghard_cli.methods.spectral_merge import SpectralMergeOp
    from dghard_cli.spectral.spectrum import ShrinkSpec

    policy = ctx.options.policy
    matrix = matrix_eligibility(policy)

    def is_matrix(job) -> bool:
        rows = job.shared_rows if job.shared_rows is not None else (job.shape[0] if job.shape else 0)
        return (
            len(job.shape) == 2
            and rows >= 2
            and rows * job.shape[1] >= policy.min_numel
            and matrix(job.name, job.fts[0]) is None
        )

    spec = ShrinkSpec(scale=p["scale"])
    return SpectralMergeOp(spec, p["weights"], p["lambda"], ctx.device, is_matrix, ctx.block_bytes)


def merged_entries(rec: dict) -> int:
    shape = rec["shape"]
    if len(shape) >= 2 and rec.get("shared_rows") is not None:
        return rec["shared_rows"] * math.prod(shape[1:])
    return math.prod(shape)


def kept_summary(conflicts: bool) -> Callable[[list[dict], dict], dict]:
    """TIES/DARE: the share of each delta kept (and TIES' sign conflicts)."""

    def summary(rows: list[dict], p: dict) -> dict:
        out: dict = {}
        total = sum(merged_entries(r) for r in rows)
        kept = [sum(r["kept"][i] for r in rows) for i in range(len(p["weights"]))]
        out["kept_fraction"] = [k / total if total else 0.0 for k in kept]
        out["entries"] = total
        if conflicts:
            n = sum(r.get("sign_conflicts", 0) for r in rows)
            out["sign_conflicts"] = n
            out["sign_conflict_fraction"] = n / total if total else 0.0
        return out

    return summary


def _dg_hard_summary(rows: list[dict], p: dict) -> dict:
    spectral = [r for r in rows if r.get("merge_rule") == "dg-hard"]
    out: dict = {"filtered_matrices": len(spectral), "task_arithmetic_tensors": len(rows) - len(spectral)}
    if spectral:
        out["median_rank_kept"] = [
            statistics.median(r["ranks"][i] for r in spectral) for i in range(len(p["weights"]))
        ]
    return out


_SUM = ("weights", "lambda")


BUILTIN_METHODS: tuple[MergeMethod, ...] = (
    MergeMethod(
        "wise-ft", ("alpha",), _wise_ft_op, fine_tunes="one", sweep_axes=("alpha",), core_space="lossless"
    ),
    MergeMethod(
        "task-arithmetic",
        _SUM,
        _task_arithmetic_op,
        sweep_axes=("lambda",),
        sweep_fixed=("weights",),
        core_space="lossless",
    ),
    MergeMethod(
        "ties",
        (*_SUM, "density", "normalize"),
        _ties_op,
        summary=kept_summary(conflicts=True),
        check_weights=nonnegative_weights,
        sweep_axes=("density", "lambda"),
        sweep_fixed=("weights", "density", "lambda"),
        core_space="cores",
    ),
    MergeMethod(
        "dare-linear",
        (*_SUM, "density", "seed"),
        _dare_op(ties=False),
        aliases=("dare",),
        summary=kept_summary(conflicts=False),
        sweep_axes=("density", "lambda"),
        sweep_fixed=("weights", "density", "lambda", "seed"),
        core_space="cores",
    ),
    MergeMethod(
        "dare-ties",
        (*_SUM, "density", "seed", "normalize"),
        _dare_op(ties=True),
        summary=kept_summary(conflicts=True),
        check_weights=nonnegative_weights,
        sweep_axes=("density", "lambda"),
        sweep_fixed=("weights", "density", "lambda", "seed"),
        core_space="cores",
    ),
    MergeMethod("recall", ("recall", "calib"), _recall_op, calibrates=True),
    MergeMethod(
        "dg-hard",
        (*_SUM, "scale"),
        _dg_hard_op,
        summary=_dg_hard_summary,
        sweep_axes=("scale", "lambda"),
        sweep_fixed=("weights", "scale", "lambda"),
    ),
)
