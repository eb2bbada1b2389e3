"""``dghard merge``."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from dghard_cli.cli.common import (
    DEVICES,
    AllowLossyOpt,
    BaseRevisionOpt,
    CoreSpaceOpt,
    DryRunOpt,
    DtypeOpt,
    FormatOpt,
    IncludeOpt,
    JsonOpt,
    MergeOpt,
    OverwriteOpt,
    QuietOpt,
    RankOpt,
    ReportOpt,
    ResumeOpt,
    ShardSizeOpt,
    VerboseOpt,
    app,
    choices,
    emit,
    lora_options,
    run_cli,
)
from dghard_cli.errors import InputError
from dghard_cli.methods import registry

MERGE_EPILOG = """
**Examples**

    dghard merge --method ties --density 0.2 --weights 1,1 BASE FT_A FT_B --out merged

    dghard merge --method wise-ft --alpha 0.5 BASE FT --out wise

    dghard merge --method dare-ties --density 0.3 --seed 7 BASE FT_A FT_B --out m

    dghard merge --method recall BASE FT --out recalled            # built-in calibration text

    dghard merge --method dg-hard --weights 1,1 BASE FT_A FT_B --out m   # DG-Hard each delta, then sum

    dghard merge --method slerp --t 0.3 BASE FT --out m                 # spherical interpolation

    dghard merge --method della --density 0.4 --epsilon 0.1 BASE FT_A FT_B --out m

    dghard merge --method model-stock BASE FT_A FT_B FT_C --out m

    dghard merge --config configs/ties.yaml                          # a YAML recipe

    dghard merge --method ties --lines 0.2,0.6 BASE FT_A FT_B --out m   # W_base + λ(ℓ)·τ_merged
    dghard merge --config mergekit.yml --out merged                  # a mergekit recipe, unchanged
    dghard merge --method task-arithmetic BASE ADAPTER --out merged --merge   # adapter into BASE

    dghard merge --method wise-ft --alpha 0.6 BASE ADAPTER --out weaker       # an adapter, B scaled

    dghard merge --method ties --weights 1,1 BASE AD_A AD_B --out m --rank 16  # adapters -> adapter
"""


def parse_weights(text: str) -> list[float]:
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            out.append(float(part))
        except ValueError:
            raise InputError(f"--weights {text!r}: {part!r} is not a number (use e.g. 1,0.5)") from None
    return out


def _head(
    models: Annotated[
        Optional[list[str]],
        typer.Argument(
            help="BASE then one or more fine-tunes FT... (directories or Hub ids; PEFT LoRA adapters too).",
            show_default=False,
        ),
    ] = None,
    method: Annotated[
        Optional[str],
        typer.Option(
            "--method",
            "-m",
            # the list is too long for the type column: a name there, the values in the help
            metavar="<method>",
            help=f"One of: {', '.join(registry.method_names())}.",
            show_default=False,
        ),
    ] = None,
    config: Annotated[
        Optional[Path],
        typer.Option("--config", "-c", help="A YAML recipe (command-line options override it)."),
    ] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Output directory.")] = None,
) -> None:
    """The options before the method parameters."""


def _tail(
    include: IncludeOpt = None,
    exclude: Annotated[
        Optional[list[str]],
        typer.Option(help="Tensors matching this regex keep the first fine-tune's value (repeatable)."),
    ] = None,
    min_numel: Annotated[
        Optional[int], typer.Option(help="dg-hard: smaller matrices get task arithmetic (default 1024).")
    ] = None,
    shard_size: ShardSizeOpt = None,
    dtype: DtypeOpt = None,
    report: ReportOpt = None,
    dry_run: DryRunOpt = False,
    resume: ResumeOpt = False,
    overwrite: OverwriteOpt = False,
    allow_missing: Annotated[
        bool, typer.Option("--allow-missing", help="Tensors only in BASE keep their base values.")
    ] = False,
    base_revision: BaseRevisionOpt = None,
    device: Annotated[
        Optional[str],
        typer.Option(
            "--device",
            metavar=choices(DEVICES),
            help="auto, cpu, cuda or cuda:N (auto: first CUDA device if present).",
        ),
    ] = None,
    output_format: FormatOpt = "auto",
    merge_adapter: MergeOpt = False,
    rank: RankOpt = None,
    allow_lossy: AllowLossyOpt = False,
    core_space: CoreSpaceOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """The options after the method parameters."""


_PY_TYPES = {
    registry.NUMBER: float,
    registry.INT: int,
    registry.WEIGHTS: str,
    registry.PATH: Path,
    registry.SCHEDULE: str,
    registry.BOOL: bool,
    "string": str,
}


def _panel(param: registry.Param) -> str:
    """The help panel of a method parameter: the methods that take it."""
    takers = [m.name for m in registry.methods().values() if param.name in m.params]
    if not takers or len(takers) == len(registry.methods()):
        return "Parameters of every method"
    title = "Parameters of " + takers[0]
    for i, name in enumerate(takers[1:], 1):
        rest = len(takers) - i - 1
        if len(title) + len(name) + 2 + (12 if rest else 0) > 70:  # fits an 80-column panel border
            return f"{title} and {len(takers) - i} more"
        title += f", {name}"
    return title


def _option(
    name: str, kind: str, flag: str, help_text: str, values: tuple[str, ...] = (), panel: str | None = None
) -> inspect.Parameter:
    tp = Optional[_PY_TYPES[kind]]  # noqa: UP045 - typer reads the annotation at run time
    metavar = choices(values) if values else None
    if kind == registry.BOOL:  # a switch either way; not given: the method's default
        option = typer.Option(
            f"{flag}/--no-{flag[2:]}", help=help_text, show_default=False, rich_help_panel=panel
        )
    else:
        option = typer.Option(flag, help=help_text, metavar=metavar, rich_help_panel=panel)
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[tp, option]
    )


def _sub_flag(param: registry.Param, sub: registry.SubOption) -> str:
    return f"--{param.name}-{sub.name.replace('_', '-')}"


def _sub_name(param: registry.Param, sub: registry.SubOption) -> str:
    return f"{param.name}_{sub.name}"


def _param_options() -> list[inspect.Parameter]:
    """One option per method parameter of the registry (a mapping: one per key), in order."""
    out = []
    for q in registry.params().values():
        if q.kind == registry.MAPPING:
            out += [
                _option(_sub_name(q, sub), sub.kind, _sub_flag(q, sub), sub.help, sub.choices, _panel(q))
                for sub in q.sub
            ]
        else:
            out.append(_option(f"param_{q.name}", q.kind, q.cli_flag, q.help, panel=_panel(q)))
    return out


def _given_params(kw: dict) -> dict:
    """The method parameters given as options, by name (``--weights`` parsed; a mapping
    parameter: its keys given), for :class:`dghard_cli.recipes.options.Given`."""
    out: dict = {}
    for q in registry.params().values():
        if q.kind == registry.MAPPING:
            out[q.name] = {sub.name: kw[_sub_name(q, sub)] for sub in q.sub}
            continue
        value = kw[f"param_{q.name}"]
        out[q.name] = parse_weights(value) if q.kind == registry.WEIGHTS and value is not None else value
    return out


def merge_cmd(**kw) -> None:
    """Merge one or more fine-tunes of the same base: WiSE-FT, task arithmetic, TIES, DARE, RECALL, DG-Hard,
    SLERP, Breadcrumbs, DELLA, Model Stock, TSV-M, Iso-C, Iso-CTS, STAR, CART, WUDI."""

    models, method, config, out = kw["models"], kw["method"], kw["config"], kw["out"]
    base_revision, verbose, json_out = kw["base_revision"], kw["verbose"], kw["json_out"]
    dry_run, quiet = kw["dry_run"], kw["quiet"]

    def body() -> dict:
        from dghard_cli.io.out_path import precheck_out

        if out is not None:
            precheck_out(out, overwrite=kw["overwrite"])  # before seconds of imports
        from dghard_cli.engine.writer import RunOptions
        from dghard_cli.merging import merge
        from dghard_cli.recipes.options import Given, merge_call
        from dghard_cli.recipes.recipe import load_recipe

        recipe = None
        if config is not None:
            recipe = load_recipe(config)
            if models:
                raise InputError(
                    f"--config {config} names the models; do not also give BASE/FT on the command line"
                )
        given = Given(
            models=list(models or []),
            method=method,
            out=out,
            params=_given_params(kw),
            shard_size=kw["shard_size"],
            dtype=kw["dtype"],
            report=kw["report"],
            min_numel=kw["min_numel"],
            include=kw["include"] or [],
            exclude=kw["exclude"] or [],
            allow_missing=kw["allow_missing"],
            device=kw["device"],
            base_revision=base_revision,
            run=RunOptions(
                dry_run=dry_run,
                resume=True if kw["resume"] else None,
                overwrite=kw["overwrite"],
                quiet=quiet or json_out,
                notices=not quiet,
                argv=["dghard", *sys.argv[1:]],
            ),
            lora=lora_options(
                kw["output_format"], kw["merge_adapter"], kw["rank"], kw["allow_lossy"], kw["core_space"]
            ),
        )
        call = merge_call(given, recipe)
        return merge(call.base, call.fts, call.out, call.options)

    doc = run_cli(body, verbose=verbose)
    from dghard_cli.cli.render import is_adapter_doc, render_adapter, render_merge, render_plan

    if is_adapter_doc(doc):
        emit(doc, as_json=json_out, quiet=quiet, render=lambda c: render_adapter(c, doc))
    elif dry_run:
        emit(doc, as_json=json_out, quiet=quiet, render=lambda c: render_plan(c, doc, verbose))
    else:
        emit(doc, as_json=json_out, quiet=quiet, render=lambda c: render_merge(c, doc))


def _signature() -> inspect.Signature:
    keyword = [
        p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
        for f in (_head,)
        for p in inspect.signature(f, eval_str=True).parameters.values()
    ]
    tail = [
        p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
        for p in inspect.signature(_tail, eval_str=True).parameters.values()
    ]
    return inspect.Signature([*keyword, *_param_options(), *tail], return_annotation=None)


merge_cmd.__signature__ = _signature()  # type: ignore[attr-defined]
merge_cmd.__annotations__ = {p.name: p.annotation for p in merge_cmd.__signature__.parameters.values()}
app.command("merge", epilog=MERGE_EPILOG)(merge_cmd)
