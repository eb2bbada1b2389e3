"""How a merge method and its parameters are declared (see :mod:`dghard_cli.methods.registry`):
:class:`Param`, :class:`MergeMethod`, the value kinds, the shared checks, and :data:`COMMON`,
the parameters every method takes."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dghard_cli.errors import InputError
from dghard_cli.schedule.spec import LAYER_STRENGTHS_FLAG, layer_strengths_value, lines_value

#: Kinds of parameter values (also the type named in a recipe's error messages).
NUMBER, INT, WEIGHTS, PATH, MAPPING = "number", "integer", "weights", "path", "mapping"
#: A layer-strength schedule (text on the command line; text, a list or a mapping in a recipe).
SCHEDULE = "schedule"
BOOL = "boolean"  # a switch: ``--NAME/--no-NAME`` on the command line, true/false in a recipe
STRING = "string"  # a word (one of the values the check accepts)


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
    kind: str  # NUMBER | INT | WEIGHTS | PATH | MAPPING | SCHEDULE | BOOL
    help: str  # command-line help text
    default: Any = None  # the value when not given, or {method: value}
    check: Callable[[Any, MergeMethod, int], Any] | None = None  # validate (InputError) and normalise
    flag: str | None = None  # command-line flag (None: --NAME)
    attr: str | None = None  # MergeOptions field (None: MergeOptions.extra[NAME]); two may share one
    recipe: bool = True  # a top-level recipe key (weights come from ``models:`` instead)
    describe: Callable[[Any], dict] | None = None  # report entries (None: {NAME: value})
    sweep_range: tuple[float, float] | None = None  # default refinement range as a sweep axis
    sweep_log: bool = False  # refined in log coordinates by default
    sub: tuple[SubOption, ...] = ()  # the keys of a MAPPING parameter
    build: Callable[[Any], Any] | None = None  # the option's value from its keys (a MAPPING) or
    # from the command line's or a recipe's value (None: as given)

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
    #: this method's own sweep ranges of shared axes (tsv's α, a scale >= 0: (0, 3)), over
    #: ``Param.sweep_range`` (WiSE-FT's α, a weight in [0, 1])
    sweep_ranges: Mapping[str, tuple[float, float]] = field(default_factory=dict, hash=False)
    calibrates: bool = False  # runs models before merging (RECALL): OUT is checked first
    #: this method's own defaults of shared parameters (breadcrumbs: density 0.9), over ``Param.default``
    defaults: Mapping[str, Any] = field(default_factory=dict, hash=False)
    min_fine_tunes: int = 1  # model stock: at least 2
    #: checks across the resolved parameters (della: epsilon against density); InputError
    check_params: Callable[[dict, int], None] | None = None
    #: checks against the plan before anything is written (working memory, accuracy):
    #: ``check_plan(p, jobs, n_fts, policy, device)``, InputError naming the tensor
    check_plan: Callable[[dict, Any, int, Any, Any], None] | None = None
    #: ``merge --core-space`` of LoRA adapters (:mod:`dghard_cli.lora.route_core`): ``"lossless"``
    #: (the merge of the cores is the full-tensor merge: it commutes with orthogonal changes of
    #: basis and ignores the matrix's size), ``"cores"`` (an elementwise merge: the cores' merge is
    #: its own, Core Space's), None (refused: it reads BASE's weights or the matrix's size)
    core_space: str | None = None

    @property
    def all_params(self) -> tuple[str, ...]:
        return self.params + tuple(p.name for p in COMMON)

    def sweep_range(self, param: Param) -> tuple[float, float] | None:
        """The default refinement range of ``param`` as this method's sweep axis."""
        return self.sweep_ranges.get(param.name, param.sweep_range)


def finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"--{name} must be a finite number, got {value!r}")
    return float(value)


def boolean(name: str, flag: str | None = None) -> Callable[[Any, MergeMethod, int], bool]:
    """True or false."""

    def check(value: Any, method: MergeMethod, n_fts: int) -> bool:
        if not isinstance(value, bool):
            raise InputError(f"{flag or '--' + name} must be true or false, got {value!r}")
        return value

    return check


def in_range(lo: float, hi: float, name: str, what: str = "") -> Callable[[Any, MergeMethod, int], float]:
    """A finite number in [lo, hi]."""

    def check(value: Any, method: MergeMethod, n_fts: int) -> float:
        v = finite(name, value)
        if not lo <= v <= hi:
            raise InputError(f"--{name} must be in [{lo:g}, {hi:g}]{what}, got {v}")
        return v

    return check


# -- the parameters every method takes ---------------------------------------------------------
# The layer-strength schedule (LiNeS, :mod:`dghard_cli.schedule`): two spellings of one
# MergeOptions field, ``schedule`` (a LayerSchedule), at most one of them given.


def _schedule_of(form: str) -> Callable[[Any, MergeMethod, int], Any]:
    """The check of a spelling: the schedule when it is of that form (None otherwise)."""
    return lambda value, method, n_fts: value if value is not None and value.form == form else None


def _describe_schedule(value: Any) -> dict:
    return value.describe() if value is not None else {}


LINES = Param(
    "lines",
    SCHEDULE,
    "Layer-wise strengths A,B: scale each tensor's update by λ = A + B·ℓ/(L−1) "
    "(embeddings: A, final norm and head: A + B).",
    check=_schedule_of("lines"),
    attr="schedule",
    describe=_describe_schedule,
    build=lines_value,
)
LAYER_STRENGTHS = Param(
    "layer_strengths",
    SCHEDULE,
    "Explicit per-group strengths, e.g. 'embed=0.2,0-7=0.3,8-15=0.6,head=1' (every block once), "
    "or a YAML file of that mapping.",
    check=_schedule_of("groups"),
    flag=LAYER_STRENGTHS_FLAG,
    attr="schedule",
    describe=_describe_schedule,
    build=layer_strengths_value,
)

# A post-step every merge can take: SVC, singular value calibration (:mod:`dghard_cli.methods.svc`).


def _check_calibrate(value: Any, method: MergeMethod, n_fts: int) -> str | None:
    if value is not None and value != "svc":
        raise InputError(f"--calibrate must be svc (singular value calibration), got {value!r}")
    return value


def _check_svc_alpha(value: Any, method: MergeMethod, n_fts: int) -> float | None:
    if value is None:
        return None
    v = finite("svc-alpha", value)
    if not v > 0.0:
        raise InputError(f"--svc-alpha must be > 0 (the floor of SVC's overshoot ratios), got {v}")
    return v


def _given_only(name: str) -> Callable[[Any], dict]:
    """Report entries of an optional post-step's parameter: none when it was not given."""
    return lambda value: {} if value is None else {name: value}


CALIBRATE = Param(
    "calibrate",
    STRING,
    "svc: rescale the merged update's singular values (SVC), before --lines.",
    check=_check_calibrate,
    describe=_given_only("calibrate"),
)
SVC_ALPHA = Param(
    "svc_alpha",
    NUMBER,
    "SVC's floor of the overshoot ratios, > 0 (default 0.1).",
    check=_check_svc_alpha,
    flag="--svc-alpha",
    describe=_given_only("svc_alpha"),
)

#: Parameters every method takes, after its own.
COMMON: tuple[Param, ...] = (LINES, LAYER_STRENGTHS, CALIBRATE, SVC_ALPHA)
