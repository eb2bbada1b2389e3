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

A parameter every method takes goes into :data:`COMMON` (declare.py): each method then takes it
after its own parameters, with no change to any method. The layer-strength schedule is one
(``--lines``, ``--layer-strengths``: two spellings of ``MergeOptions.schedule``).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from dghard_cli.errors import InputError
from dghard_cli.methods.builtin import BUILTIN_METHODS, BUILTIN_PARAMS
from dghard_cli.methods.declare import (  # noqa: F401 - what a method module imports from here
    BOOL,
    COMMON,
    INT,
    MAPPING,
    NUMBER,
    PATH,
    SCHEDULE,
    STRING,
    WEIGHTS,
    BuildContext,
    MergeMethod,
    Param,
    SubOption,
    boolean,
    finite,
    in_range,
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
    params += list(COMMON)  # every method takes them, after its own
    by_param = {p.name: p for p in params}
    by_method = {m.name: m for m in methods}
    if len(by_param) != len(params) or len(by_method) != len(methods):
        raise AssertionError("two merge methods (or two parameters) share a name")
    for m in methods:
        for name in m.all_params:
            if name not in by_param:
                raise AssertionError(f"merge method {m.name}: undeclared parameter {name!r}")
    aliases = {a: m.name for m in methods for a in m.aliases}
    return Registry(by_method, by_param, aliases)


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
    """MergeOptions keyword arguments and ``extra`` for parameter values given by name (None:
    not given); InputError when two parameters of one field (``--lines``, ``--layer-strengths``)
    are both given."""
    kwargs: dict = {}
    extra: dict = {}
    by: dict[str, Param] = {}
    for name, value in values.items():
        param = params()[name]
        if value is None:
            continue
        if param.attr is not None:
            if param.attr in by:
                raise InputError(f"give either {by[param.attr].cli_flag} or {param.cli_flag}, not both")
            by[param.attr] = param
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
    if n_fts < method.min_fine_tunes:
        raise InputError(
            f"--method {method.name} needs at least {method.min_fine_tunes} fine-tunes; got {n_fts}"
        )
    out: dict = {"method": method.name}
    for name in takes:
        param = params()[name]
        value = given_value(opts, param)
        if value is None:
            value = method.defaults[name] if name in method.defaults else param.default_for(method.name)
        if param.check is not None:
            value = param.check(value, method, n_fts)
        out.update(param.describe(value) if param.describe is not None else {name: value})
    if method.check_params is not None:
        method.check_params(out, n_fts)
    return out


def takes_text(method: MergeMethod) -> str:
    return ", ".join(params()[n].listed for n in sorted(method.all_params))


def scalar_params() -> list[Param]:
    """Numeric parameters a sweep candidate carries and a reproduction command spells out, in order."""
    return [p for p in params().values() if p.scalar]


def carried_params() -> list[Param]:
    """Every parameter a sweep candidate carries and a reproduction command spells out, in order:
    the numeric ones, then the words (``--calibrate svc``, a follow-up's post-step)."""
    return scalar_params() + [p for p in params().values() if p.kind == STRING]


def recipe_keys() -> dict[str, str]:
    """Top-level recipe keys of the method parameters and their kinds, in order."""
    kinds = {
        NUMBER: "number",
        INT: "integer",
        PATH: "string",
        MAPPING: "mapping",
        SCHEDULE: "schedule",
        BOOL: "boolean",
        STRING: "string",
    }
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
