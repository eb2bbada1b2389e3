"""The merge methods and their parameters, declared once.

Everything about a merge parameter lives in its :class:`Param`: the name (the key in the
report's ``parameters``, in a YAML recipe and in a sweep candidate file), the default, the
check, the command-line flag and help text, and the sweep range of an axis. Everything about a
method lives in its :class:`MergeMethod`: the parameters it takes, how it is built into a
per-tensor operation, and its report summary. ``dghard merge`` (options, recipe keys,
validation, the operation, the summary shown), ``dghard sweep`` (the merge families, their
axes and ranges, the reproduction command) all derive from here.

Adding a method
---------------

Write one module in ``dghard_cli/methods/`` (plus its test) that holds the math, the kernel
and, at the bottom, ``MERGE_METHODS = (MergeMethod(...),)``; it is found by :func:`methods`
(every module of the package that defines ``MERGE_METHODS`` is read, after the built-in ones,
in module-name order). A parameter only that method takes is declared in the same module
(``PARAMS = (Param(...),)``); its value reaches the method as ``p[name]`` and, from the library,
through ``MergeOptions.extra[name]``. A sketch::

    # dghard_cli/methods/slerp.py
    from dghard_cli.methods.merge_ops import ElementwiseMergeOp, Kernel
    from dghard_cli.methods.registry import NUMBER, MergeMethod, Param, in_range

    class SlerpKernel(Kernel): ...

    PARAMS = (Param("t", NUMBER, default=0.5, check=in_range(0.0, 1.0, "t"),
                    help="slerp: position between BASE and the fine-tune, 0..1 (default 0.5).",
                    sweep_range=(0.0, 1.0)),)
    MERGE_METHODS = (MergeMethod("slerp", ("t",), fine_tunes="one", sweep_axes=("t",),
                     make_op=lambda p, ctx: ElementwiseMergeOp(
                         lambda job: SlerpKernel(p["t"]), ctx.device, ctx.block_bytes)),)

A parameter every method takes (a layer-strength schedule, say) goes into :data:`COMMON`:
each method then takes it after its own parameters, with no change to any method.
"""

from __future__ import annotations

import importlib
import math
import pkgutil
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from dghard_cli.errors import InputError
from dghard_cli.methods import recall as R

#: Kinds of parameter values (also the type named in a recipe's error messages).
NUMBER, INT, WEIGHTS, PATH, MAPPING = "number", "integer", "weights", "path", "mapping"


@dataclass(frozen=True)
class SubOption:
    """One key of a mapping parameter (``recall:`` in a recipe, ``--recall-KEY`` on the CLI)."""

    name: str
    kind: str  # "number" | "integer" | "string"
    help: str
    choices: tuple[str, ...] = ()  # the values a "string" key takes (the help lists them)


@dataclass(frozen=True)
class Param:
    """One merge parameter, as every surface sees it."""

    name: str  # report ``parameters`` key, recipe key, sweep axis/fixed key
    kind: str  # NUMBER | INT | WEIGHTS | PATH | MAPPING
    help: str  # command-line help text
    default: Any = None  # the value when not given, or {method: value}
    check: Callable[[Any, MergeMethod, int], Any] | None = None  # validate (InputError) and normalise
    flag: str | None = None  # command-line flag (None: --NAME)
    attr: str | None = None  # MergeOptions field (None: MergeOptions.extra[NAME])
    recipe: bool = True  # a top-level recipe key (weights come from ``models:`` instead)
    describe: Callable[[Any], dict] | None = None  # report entries (None: {NAME: value})
    sweep_range: tuple[float, float] | None = None  # default refinement range as a sweep axis
    sweep_log: bool = False  # refined in log coordinates by default
    sub: tuple[SubOption, ...] = ()  # the keys of a MAPPING parameter
    build: Callable[[dict], Any] | None = None  # a MAPPING parameter's value from its keys

    @property
    def cli_flag(self) -> str:
        return self.flag or f"--{self.name}"

    @property
    def label(self) -> str:
        """How messages name the parameter (a mapping: all its flags)."""
        return f"--{self.name}-*" if self.kind == MAPPING else self.cli_flag

    @property
    def listed(self) -> str:
        return f"--{self.name}-* options" if self.kind == MAPPING else self.cli_flag

    @property
    def scalar(self) -> bool:
        """A value a sweep candidate carries and the reproduction command spells out."""
        return self.kind in (NUMBER, INT, WEIGHTS)

    def default_for(self, method: str) -> Any:
        return self.default.get(method) if isinstance(self.default, Mapping) else self.default


@dataclass
class BuildContext:
    """What a method's operation is built from besides its parameters."""

    options: Any  # the MergeOptions
    device: Any  # torch.device
    recall_weights: Any = None  # RECALL's calibrated weights (RecallWeights), else None

    @property
    def block_bytes(self) -> int:
        return self.options.block_bytes


@dataclass(frozen=True)
class MergeMethod:
    """One merge method: its parameters, its operation and its report summary."""

    name: str
    params: tuple[str, ...]  # names of the parameters it takes, in report order
    make_op: Callable[[dict, BuildContext], Any]  # -> a TensorOp (see dghard_cli.engine.ops)
    fine_tunes: str = "any"  # "one": exactly one fine-tune | "any"
    aliases: tuple[str, ...] = ()
    summary: Callable[[list[dict], dict], dict] | None = None  # extra ``merge`` report entries
    check_weights: Callable[[str, list[float]], None] | None = None  # more rules on --weights
    sweep_axes: tuple[str, ...] = ()  # parameters a sweep family may sweep (first: default); () = none
    sweep_fixed: tuple[str, ...] = ()  # parameters a sweep family may fix
    calibrates: bool = False  # runs models before merging (RECALL): OUT is checked first

    @property
    def all_params(self) -> tuple[str, ...]:
        return self.params + tuple(p.name for p in COMMON)


# -- checks ------------------------------------------------------------------------------------


def finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"--{name} must be a finite number, got {value!r}")
    return float(value)


def in_range(lo: float, hi: float, name: str, what: str = "") -> Callable[[Any, MergeMethod, int], float]:
    """A finite number in [lo, hi]."""

    def check(value: Any, method: MergeMethod, n_fts: int) -> float:
        v = finite(name, value)
        if not lo <= v <= hi:
            raise InputError(f"--{name} must be in [{lo:g}, {hi:g}]{what}, got {v}")
        return v

    return check


def _any_finite(name: str) -> Callable[[Any, MergeMethod, int], float]:
    return lambda value, method, n_fts: finite(name, value)


def _check_alpha(value: Any, method: MergeMethod, n_fts: int) -> float:
    return in_range(0.0, 1.0, "alpha", " (0 = BASE, 1 = the fine-tune)")(value, method, n_fts)


def _check_weights(value: Any, method: MergeMethod, n_fts: int) -> list[float]:
    w = [1.0] * n_fts if value is None else [finite("weights", x) for x in value]
    if len(w) != n_fts:
        raise InputError(f"--weights has {len(w)} value(s) but {n_fts} fine-tune(s) were given")
    if method.check_weights is not None:
        method.check_weights(method.name, w)
    return w


def _check_density(value: Any, method: MergeMethod, n_fts: int) -> float:
    d = finite("density", value)
    if not 0.0 < d <= 1.0:
        raise InputError(f"--density is the fraction of each delta kept and must be in (0, 1], got {d}")
    return d


def _check_seed(value: Any, method: MergeMethod, n_fts: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InputError(f"--seed must be an integer >= 0, got {value!r}")
    return value


def _nonnegative_weights(method: str, w: list[float]) -> None:
    """A disjoint mean (TIES' election) needs weights >= 0, one of them > 0."""
    if any(x < 0 for x in w):
        raise InputError(
            f"--method {method} takes weights >= 0 (a disjoint mean with negative weights is "
            "not a mean); to subtract a task vector use task-arithmetic or dare-linear"
        )
    if not any(x > 0 for x in w):
        raise InputError(f"--method {method}: at least one weight must be > 0")


# -- report entries ----------------------------------------------------------------------------


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


# -- the built-in parameters, in the order every surface lists them ----------------------------

_SCALE_RANGE = (0.25, 16.0)
_LAMBDA_RANGE = (0.0, 2.0)

BUILTIN_PARAMS: tuple[Param, ...] = (
    Param(
        "alpha",
        NUMBER,
        "wise-ft: weight of the fine-tune, 0..1 (default 0.5).",
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
        "Scales the merged delta (default 1).",
        default=1.0,
        check=_any_finite("lambda"),
        attr="lam",
        sweep_range=_LAMBDA_RANGE,
    ),
    Param(
        "density",
        NUMBER,
        "ties/dare: fraction of each delta kept (default ties 0.2, dare 0.5).",
        default={"ties": 0.2, "dare-linear": 0.5, "dare-ties": 0.5},
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
)

#: Parameters every method takes, after its own (none yet).
COMMON: tuple[Param, ...] = ()


# -- the built-in methods ----------------------------------------------------------------------


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
        lambda job: TiesKernel(p["weights"], p["lambda"], p["density"], merged_numel(job)),
        ctx.device,
        ctx.block_bytes,
        ctx.options.whole_bytes,
    )


def _dare_op(ties: bool) -> Callable[[dict, BuildContext], Any]:
    def make(p: dict, ctx: BuildContext):
        from dghard_cli.methods.merge_ops import DareKernel, ElementwiseMergeOp, merged_numel

        return ElementwiseMergeOp(
            lambda job: DareKernel(
                p["weights"], p["lambda"], p["density"], p["seed"], job.name, merged_numel(job), ties=ties
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
    from dghard_cli.methods.merge_ops import SpectralMergeOp
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


def _kept_summary(conflicts: bool) -> Callable[[list[dict], dict], dict]:
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
    MergeMethod("wise-ft", ("alpha",), _wise_ft_op, fine_tunes="one", sweep_axes=("alpha",)),
    MergeMethod(
        "task-arithmetic", _SUM, _task_arithmetic_op, sweep_axes=("lambda",), sweep_fixed=("weights",)
    ),
    MergeMethod(
        "ties",
        (*_SUM, "density"),
        _ties_op,
        summary=_kept_summary(conflicts=True),
        check_weights=_nonnegative_weights,
        sweep_axes=("density", "lambda"),
        sweep_fixed=("weights", "density", "lambda"),
    ),
    MergeMethod(
        "dare-linear",
        (*_SUM, "density", "seed"),
        _dare_op(ties=False),
        aliases=("dare",),
        summary=_kept_summary(conflicts=False),
        sweep_axes=("density", "lambda"),
        sweep_fixed=("weights", "density", "lambda", "seed"),
    ),
    MergeMethod(
        "dare-ties",
        (*_SUM, "density", "seed"),
        _dare_op(ties=True),
        summary=_kept_summary(conflicts=True),
        check_weights=_nonnegative_weights,
        sweep_axes=("density", "lambda"),
        sweep_fixed=("weights", "density", "lambda", "seed"),
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


# -- the registry ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Registry:
    methods: dict[str, MergeMethod]
    params: dict[str, Param]
    aliases: dict[str, str] = field(default_factory=dict)

    @property
    def names(self) -> tuple[str, ...]:
        """Every accepted ``--method`` value, aliases just before their method."""
        out: list[str] = []
        for m in self.methods.values():
            out += [*m.aliases, m.name]
        return tuple(out)


@lru_cache(maxsize=1)
def registry() -> Registry:
    """The built-in methods, then those of every ``dghard_cli.methods`` module with ``MERGE_METHODS``."""
    import dghard_cli.methods as package

    methods = list(BUILTIN_METHODS)
    params = list(BUILTIN_PARAMS)
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        methods += list(getattr(module, "MERGE_METHODS", ()))
        params += list(getattr(module, "PARAMS", ()))
    by_param = {p.name: p for p in params}
    by_method = {m.name: m for m in methods}
    if len(by_param) != len(params) or len(by_method) != len(methods):
        raise AssertionError("two merge methods (or two parameters) share a name")
    for m in methods:
        for name in m.all_params:
            if name not in by_param:
                raise AssertionError(f"merge method {m.name}: undeclared parameter {name!r}")
    aliases = {a: m.name for m in methods for a in m.aliases}
    return Registry(by_method, {**by_param, **{p.name: p for p in COMMON}}, aliases)


def methods() -> dict[str, MergeMethod]:
    return registry().methods


def params() -> dict[str, Param]:
    return registry().params


def method_names() -> tuple[str, ...]:
    return registry().names


def get_method(method: str) -> MergeMethod:
    """The method a ``--method`` value names (aliases resolved); InputError otherwise."""
    reg = registry()
    m = (method or "").strip().lower()
    if m not in reg.names:
        raise InputError(f"--method {method!r} is not one of {', '.join(reg.names)}")
    return reg.methods[reg.aliases.get(m, m)]


def given_value(opts: Any, param: Param) -> Any:
    """The value of ``param`` in a MergeOptions (None: not given)."""
    if param.attr is not None:
        return getattr(opts, param.attr)
    return (getattr(opts, "extra", None) or {}).get(param.name)


def options_values(values: Mapping[str, Any]) -> tuple[dict, dict]:
    """MergeOptions keyword arguments and ``extra`` for parameter values given by name."""
    kwargs: dict = {}
    extra: dict = {}
    for name, value in values.items():
        param = params()[name]
        if param.attr is not None:
            kwargs[param.attr] = value
        else:
            extra[name] = value
    return kwargs, extra


def resolve(opts: Any, n_fts: int) -> dict:
    """The effective parameters of ``opts.method`` (defaults filled in), validated, in report
    order; InputError naming the flag otherwise."""
    method = get_method(opts.method)
    takes = method.all_params
    for param in params().values():
        if given_value(opts, param) is not None and param.name not in takes:
            raise InputError(
                f"{param.label} does not apply to --method {method.name} (it takes: {takes_text(method)})"
            )
    if n_fts < 1:
        raise InputError("merge needs at least one fine-tuned checkpoint after BASE")
    if method.fine_tunes == "one" and n_fts != 1:
        raise InputError(
            f"--method {method.name} interpolates BASE and one fine-tune; got {n_fts} fine-tunes"
        )
    out: dict = {"method": method.name}
    for name in takes:
        param = params()[name]
        value = given_value(opts, param)
        if value is None:
            value = param.default_for(method.name)
        if param.check is not None:
            value = param.check(value, method, n_fts)
        out.update(param.describe(value) if param.describe is not None else {name: value})
    return out


def takes_text(method: MergeMethod) -> str:
    return ", ".join(params()[n].listed for n in sorted(method.all_params))


def scalar_params() -> list[Param]:
    """Parameters a sweep candidate carries and a reproduction command spells out, in order."""
    return [p for p in params().values() if p.scalar]


def recipe_keys() -> dict[str, str]:
    """Top-level recipe keys of the method parameters and their kinds, in order."""
    kinds = {NUMBER: "number", INT: "integer", PATH: "string", MAPPING: "mapping"}
    return {p.name: kinds[p.kind] for p in params().values() if p.recipe}


def mapping_params() -> list[str]:
    """Parameters given as a mapping of keys (``recall:``)."""
    return [p.name for p in params().values() if p.kind == MAPPING]


def sub_keys(name: str) -> dict[str, str]:
    """The keys of a mapping parameter (``recall:``) and their kinds."""
    return {s.name: s.kind for s in params()[name].sub}


def summary(method: str, records: Sequence[dict], p: dict) -> dict:
    """Method-level totals for the report's ``merge`` section."""
    rows = [r for r in records if r["action"] in ("method", "resized")]
    out: dict = {"method_tensors": len(rows)}
    m = methods()[method]
    if m.summary is not None:
        out.update(m.summary(rows, p))
    return out
