"""``dghard merge``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.text import Text

from dghard_cli.cli.common import (
    BaseRevisionOpt,
    IncludeOpt,
    JsonOpt,
    OverwriteOpt,
    QuietOpt,
    VerboseOpt,
    app,
    emit,
    run_cli,
)
from dghard_cli.cli.lora_options import (
    FormatOpt,
    MergeOpt,
    RankOpt,
    is_adapter_doc,
    lora_options,
    render_adapter,
)
from dghard_cli.cli.repair import render_plan
from dghard_cli.engine.plan import PolicyOptions, parse_size
from dghard_cli.engine.runner import RunOptions
from dghard_cli.errors import InputError
from dghard_cli.io.safetensors_format import parse_dtype_option
from dghard_cli.merge import METHODS, MergeOptions, merge
from dghard_cli.methods.calibration import RecallOptions
from dghard_cli.methods.recipe import load_recipe

MERGE_EPILOG = """
**Examples**

    dghard merge --method ties --density 0.2 --weights 1,1 BASE FT_A FT_B --out merged

    dghard merge --method wise-ft --alpha 0.5 BASE FT --out wise

    dghard merge --method dare-ties --density 0.3 --seed 7 BASE FT_A FT_B --out m

    dghard merge --method recall BASE FT --out recalled            # built-in calibration text

    dghard merge --method dg-hard --weights 1,1 BASE FT_A FT_B --out m   # DG-Hard each delta, then sum

    dghard merge --config configs/ties.yaml                          # a YAML recipe

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


def render_merge(console: Console, doc: dict) -> None:
    from rich.table import Table

    from dghard_cli.report.build import summary_table

    console.print(summary_table(doc))
    m = doc.get("merge", {})
    p = doc.get("parameters", {})
    t = Table(show_header=False, box=None)
    t.add_column(style="bold")
    t.add_column()
    shown = {k: p[k] for k in ("alpha", "weights", "lambda", "density", "seed", "scale") if k in p}
    if shown:
        t.add_row("parameters", ", ".join(f"{k}={v}" for k, v in shown.items()))
    if "kept_fraction" in m:
        t.add_row("kept", ", ".join(f"{100 * k:.2f} %" for k in m["kept_fraction"]) + " of each delta")
    if "sign_conflicts" in m:
        t.add_row(
            "sign conflicts", f"{m['sign_conflicts']} entries ({100 * m['sign_conflict_fraction']:.2f} %)"
        )
    if "filtered_matrices" in m:
        t.add_row(
            "dg-hard",
            f"{m['filtered_matrices']} matrices filtered, {m['task_arithmetic_tensors']} tensors by task arithmetic",
        )
    if m.get("median_rank_kept"):
        t.add_row("median rank kept", ", ".join(str(r) for r in m["median_rank_kept"]))
    console.print(t)
    rc = doc.get("recall")
    if rc:
        console.print(Text("RECALL merge weights per layer:"))
        lt = Table(box=None)
        lt.add_column("layer")
        for name in rc["models"]:
            lt.add_column(name, justify="right")
        for layer in rc["layers"]:
            lt.add_row(layer["group"], *(f"{w:.3f}" for w in layer["weights"]))
        console.print(lt)


@app.command("merge", epilog=MERGE_EPILOG)
def merge_cmd(
    models: Annotated[
        Optional[list[str]],
        typer.Argument(
            help="BASE then one or more fine-tunes FT... (directories or Hub ids).", show_default=False
        ),
    ] = None,
    method: Annotated[
        Optional[str],
        typer.Option("--method", "-m", help=f"One of: {', '.join(METHODS)}.", show_default=False),
    ] = None,
    config: Annotated[
        Optional[Path],
        typer.Option("--config", "-c", help="A YAML recipe (command-line options override it)."),
    ] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Output directory.")] = None,
    alpha: Annotated[
        Optional[float], typer.Option(help="wise-ft: weight of the fine-tune, 0..1 (default 0.5).")
    ] = None,
    weights: Annotated[
        Optional[str],
        typer.Option(help="One weight per fine-tune, comma-separated, e.g. 1,0.5 (default 1 each)."),
    ] = None,
    lam: Annotated[
        Optional[float], typer.Option("--lambda", help="Scales the merged delta (default 1).")
    ] = None,
    density: Annotated[
        Optional[float],
        typer.Option(help="ties/dare: fraction of each delta kept (default ties 0.2, dare 0.5)."),
    ] = None,
    seed: Annotated[Optional[int], typer.Option(help="dare: seed of the random drop (default 0).")] = None,
    scale: Annotated[
        Optional[float], typer.Option(help="dg-hard: multiplies the Gavish–Donoho threshold (default 1).")
    ] = None,
    calib: Annotated[
        Optional[Path],
        typer.Option(help="recall: calibration text (.txt, samples split by blank lines) or .jsonl."),
    ] = None,
    recall_kernel: Annotated[
        Optional[str], typer.Option(help="recall: linear-cka (default), rbf-cka or cosine.")
    ] = None,
    recall_pooling: Annotated[
        Optional[str],
        typer.Option(help="recall: token (every token a row; default) or mean (one row per sample)."),
    ] = None,
    recall_temperature: Annotated[
        Optional[float], typer.Option(help="recall: softmax temperature (default 0.05).")
    ] = None,
    recall_samples: Annotated[
        Optional[int], typer.Option(help="recall: number of typical samples (default 8).")
    ] = None,
    recall_select: Annotated[
        Optional[str], typer.Option(help="recall: kmeans (typical samples; default) or first.")
    ] = None,
    recall_max_tokens: Annotated[
        Optional[int], typer.Option(help="recall: tokens per sample (default 64).")
    ] = None,
    include: IncludeOpt = None,
    exclude: Annotated[
        Optional[list[str]],
        typer.Option(help="Tensors matching this regex keep the first fine-tune's value (repeatable)."),
    ] = None,
    min_numel: Annotated[
        Optional[int], typer.Option(help="dg-hard: smaller matrices get task arithmetic (default 1024).")
    ] = None,
    shard_size: Annotated[
        Optional[str],
        typer.Option(help="Output shard size, e.g. 5GB (default: mirror the first FT's shards)."),
    ] = None,
    dtype: Annotated[
        Optional[str],
        typer.Option(help="Output dtype of floating tensors: bf16, fp16, fp32 (default: FT's)."),
    ] = None,
    report: Annotated[
        Optional[Path], typer.Option(help="Where to write the JSON report (default OUT/dghard_report.json).")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Plan only; read headers, run no model.")
    ] = False,
    resume: Annotated[
        bool, typer.Option("--resume", help="Require resuming an interrupted run of the same command.")
    ] = False,
    overwrite: OverwriteOpt = False,
    allow_missing: Annotated[
        bool, typer.Option("--allow-missing", help="Tensors only in BASE keep their base values.")
    ] = False,
    base_revision: BaseRevisionOpt = None,
    device: Annotated[
        Optional[str],
        typer.Option("--device", help="auto, cpu, cuda or cuda:N (auto: first CUDA device if present)."),
    ] = None,
    output_format: FormatOpt = "auto",
    merge_adapter: MergeOpt = False,
    rank: RankOpt = None,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Merge one or more fine-tunes of the same base: WiSE-FT, task arithmetic, TIES, DARE, RECALL, DG-Hard."""

    def body() -> dict:
        values: dict = {}
        recall_cfg: dict = {}
        ft_revisions = None
        rev_base = base_revision
        if config is not None:
            recipe = load_recipe(config)
            if models:
                raise InputError(
                    f"--config {config} names the models; do not also give BASE/FT on the command line"
                )
            base = recipe.base.spec
            fts = [m.spec for m in recipe.models]
            ft_revisions = [m.revision for m in recipe.models]
            rev_base = base_revision or recipe.base.revision
            values = dict(recipe.values)
            if recipe.weights is not None:
                values["weights"] = recipe.weights
            values["method"] = recipe.method
            recall_cfg = dict(recipe.recall)
        else:
            if not models or len(models) < 2:
                raise InputError(
                    "give BASE and at least one fine-tune (dghard merge --method M BASE FT... --out OUT)"
                )
            base, fts = models[0], list(models[1:])

        def pick(cli_value, key):
            return cli_value if cli_value is not None else values.get(key)

        chosen_method = pick(method, "method")
        if chosen_method is None:
            raise InputError("--method is required (or 'method:' in the --config recipe)")
        out_dir = pick(out, "out")
        if out_dir is None:
            raise InputError("--out is required (or 'out:' in the --config recipe)")
        cli_recall = {
            "kernel": recall_kernel,
            "pooling": recall_pooling,
            "temperature": recall_temperature,
            "samples": recall_samples,
            "select": recall_select,
            "max_tokens": recall_max_tokens,
        }
        for k, v in cli_recall.items():
            if v is not None:
                recall_cfg[k] = v
        recall_opts = RecallOptions(**recall_cfg) if recall_cfg else None
        shard = pick(shard_size, "shard_size")
        dt = pick(dtype, "dtype")
        rp = pick(report, "report")
        cal = pick(calib, "calib")
        opts = MergeOptions(
            method=chosen_method,
            alpha=pick(alpha, "alpha"),
            weights=parse_weights(weights) if weights is not None else values.get("weights"),
            lam=pick(lam, "lambda"),
            density=pick(density, "density"),
            seed=pick(seed, "seed"),
            scale=pick(scale, "scale"),
            calib=Path(cal) if cal is not None else None,
            recall=recall_opts,
            policy=PolicyOptions(
                min_numel=pick(min_numel, "min_numel") if pick(min_numel, "min_numel") is not None else 1024,
                include=include or values.get("include") or [],
                exclude=exclude or values.get("exclude") or [],
                allow_missing=allow_missing or bool(values.get("allow_missing", False)),
                out_dtype=parse_dtype_option(dt) if dt else None,
                shard_size=(shard if isinstance(shard, int) else parse_size(shard))
                if shard is not None
                else None,
            ),
            run=RunOptions(
                device=pick(device, "device") or "auto",
                dry_run=dry_run,
                resume=True if resume else None,
                overwrite=overwrite,
                report_path=Path(rp) if rp is not None else None,
                quiet=quiet or json_out,
                argv=["dghard", *sys.argv[1:]],
            ),
            base_revision=rev_base,
            ft_revisions=ft_revisions,
            create_parents=out is None,  # the recipe's out: its parent directories are made
            lora=lora_options(output_format, merge_adapter, rank),
        )
        return merge(base, fts, Path(out_dir), opts)

    doc = run_cli(body, verbose=verbose)
    if is_adapter_doc(doc):
        emit(doc, as_json=json_out, quiet=quiet, render=lambda c: render_adapter(c, doc))
    elif dry_run:
        emit(doc, as_json=json_out, quiet=quiet, render=lambda c: render_plan(c, doc, verbose))
    else:
        emit(doc, as_json=json_out, quiet=quiet, render=lambda c: render_merge(c, doc))
