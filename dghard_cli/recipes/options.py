"""A recipe and what the caller gives beside it, turned into the library's merge call.

The one place that decides which value wins — the caller's (the command line's), else the
recipe's, else the method's default — for ``dghard merge --config`` and for :func:`run_recipe`,
the library's way to run a recipe (mergekit's ``run_merge(config)``)::

    from dghard_cli.recipes.options import run_recipe
    report = run_recipe("ties.yml", out="merged")          # a dghard or a mergekit recipe

A parameter given by the caller overrides every recipe key of the same option (``--lines``
overrides ``layer_strengths:`` too) and the recipe's per-tensor values of it (a mergekit
recipe's gradients and filters).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dghard_cli.engine.plan import PolicyOptions, parse_size
from dghard_cli.engine.writer import RunOptions
from dghard_cli.errors import InputError
from dghard_cli.io.paths import Output, check_outputs
from dghard_cli.io.safetensors_format import parse_dtype_option
from dghard_cli.lora.output import LoraOutputOptions
from dghard_cli.merging import MergeOptions
from dghard_cli.methods import registry
from dghard_cli.recipes.recipe import Recipe, load_recipe


@dataclass
class Given:
    """What the caller gives beside a recipe (None or empty: not given, the recipe decides)."""

    models: list[str] = field(default_factory=list)  # BASE then the fine-tunes, without a recipe
    method: str | None = None
    out: str | Path | None = None
    #: method parameters by name (``weights`` a list of numbers); a mapping parameter
    #: (``recall``): the keys given, ``{key: value}``
    params: dict[str, Any] = field(default_factory=dict)
    shard_size: str | int | None = None
    dtype: str | None = None
    report: str | Path | None = None
    min_numel: int | None = None
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    allow_missing: bool = False
    device: str | None = None
    base_revision: str | None = None
    #: how to run (dry run, resume, overwrite, quiet, argv); its device and report path come
    #: from ``device`` and ``report`` (or the recipe)
    run: RunOptions = field(default_factory=RunOptions)
    lora: LoraOutputOptions = field(default_factory=LoraOutputOptions)


@dataclass
class MergeCall:
    """The arguments of :func:`dghard_cli.merging.merge`."""

    base: str
    fts: list[str]
    out: Path
    options: MergeOptions


def param_values(given: dict[str, Any], recipe_values: dict, recipe_maps: dict, where: str | None) -> dict:
    """Each method parameter's value: the caller's, else the recipe's (``where`` names it in
    messages), else None. A field given by the caller (``--lines``) overrides every recipe key
    of it (``layer_strengths:`` too)."""
    values: dict = {}
    params = registry.params().values()
    on_cli = {
        q.attr
        for q in params
        if q.attr is not None and q.kind != registry.MAPPING and given.get(q.name) is not None
    }
    for q in params:
        if q.kind == registry.MAPPING:
            cfg = dict(recipe_maps.get(q.name, {}))
            cfg.update({k: v for k, v in (given.get(q.name) or {}).items() if v is not None})
            values[q.name] = q.build(cfg) if cfg and q.build is not None else (cfg or None)
            continue
        cli = given.get(q.name)
        v = cli if cli is not None or q.attr in on_cli else recipe_values.get(q.name)
        if v is not None and q.build is not None:
            try:
                v = q.build(v)
            except InputError as exc:
                raise InputError(f"{where}: {exc}" if cli is None and where else str(exc)) from None
        values[q.name] = Path(v) if q.kind == registry.PATH and v is not None else v
    return values


def given_names(given: dict[str, Any]) -> set[str]:
    """The method parameters the caller gave (they win over a recipe's per-tensor values)."""
    out = set()
    for q in registry.params().values():
        v = given.get(q.name)
        if q.kind == registry.MAPPING:
            if any(x is not None for x in (v or {}).values()):
                out.add(q.name)
        elif v is not None:
            out.add(q.name)
    return out


def merge_call(given: Given, recipe: Recipe | None) -> MergeCall:
    """The merge ``given`` and ``recipe`` (None: the caller names everything) ask for; InputError
    with one line naming the option or the recipe key otherwise."""
    values: dict = {}
    maps: dict = {}
    ft_revisions = None
    rev_base = given.base_revision
    where = f"recipe {recipe.path}" if recipe is not None else None
    if recipe is not None:
        base = recipe.base.spec
        fts = [m.spec for m in recipe.models]
        ft_revisions = [m.revision for m in recipe.models]
        rev_base = given.base_revision or recipe.base.revision
        values = dict(recipe.values)
        if recipe.weights is not None:
            values["weights"] = recipe.weights
        if recipe.densities is not None:
            values["density"] = recipe.densities
        values["method"] = recipe.method
        maps = recipe.maps
    else:
        if len(given.models) < 2:
            raise InputError(
                "give BASE and at least one fine-tune (dghard merge --method M BASE FT... --out OUT)"
            )
        base, fts = given.models[0], list(given.models[1:])

    def pick(key: str, value: Any) -> Any:
        return value if value is not None else values.get(key)

    method = pick("method", given.method)
    if method is None:
        raise InputError("--method is required (or 'method:' in the --config recipe)")
    out = pick("out", given.out)
    if out is None and recipe is not None and recipe.mergekit:
        raise InputError(
            f"--out OUT is required with the mergekit recipe {recipe.path} (mergekit-yaml's OUT argument)"
        )
    if out is None:
        raise InputError("--out is required (or 'out:' in the --config recipe)")
    by_name = param_values(given.params, values, maps, where)
    kwargs, extra = registry.options_values(by_name)
    shard = pick("shard_size", given.shard_size)
    dtype = pick("dtype", given.dtype)
    report = pick("report", given.report)
    min_numel = pick("min_numel", given.min_numel)
    options = MergeOptions(
        method=method,
        **kwargs,
        extra=extra,
        policy=PolicyOptions(
            min_numel=min_numel if min_numel is not None else 1024,
            include=given.include or values.get("include") or [],
            exclude=given.exclude or values.get("exclude") or [],
            allow_missing=given.allow_missing or bool(values.get("allow_missing", False)),
            out_dtype=parse_dtype_option(dtype) if dtype else None,
            shard_size=(shard if isinstance(shard, int) else parse_size(shard))
            if shard is not None
            else None,
        ),
        run=dataclasses.replace(
            given.run,
            device=pick("device", given.device) or "auto",
            report_path=Path(report) if report is not None else None,
        ),
        base_revision=rev_base,
        ft_revisions=ft_revisions,
        create_parents=given.out is None,  # the recipe's out: its parent directories are made
        tensor_parameters=(
            recipe.tensor_parameters.without(given_names(given.params))  # the caller's values win
            if recipe is not None and recipe.tensor_parameters is not None
            else None
        ),
        lora=given.lora,
        tokenizer_source=recipe.tokenizer_source if recipe is not None else None,
    )
    if report is not None:  # the recipe and a method's input files (--calib) are inputs too
        inputs: list[tuple[str, Any]] = [("--config", recipe.path if recipe is not None else None)]
        inputs += [
            (q.cli_flag, by_name.get(q.name)) for q in registry.params().values() if q.kind == registry.PATH
        ]
        check_outputs(inputs, [Output("--report", Path(report))])
    return MergeCall(base, fts, Path(out), options)


def run_recipe(path: str | Path, *, out: str | Path | None = None, **given: Any) -> dict:
    """Run a dghard or mergekit YAML recipe (``out``: OUT, else the recipe's ``out:``; ``given``:
    any other :class:`Given` field, which wins over the recipe); returns the report."""
    from dghard_cli.merging import merge

    call = merge_call(Given(out=out, **given), load_recipe(path))
    return merge(call.base, call.fts, call.out, call.options)
