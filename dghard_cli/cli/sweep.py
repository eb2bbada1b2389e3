"""``dghard sweep``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from dghard_cli.cli.common import (
    DTYPE_CHOICES,
    DeviceOpt,
    JsonOpt,
    OverwriteOpt,
    QuietOpt,
    VerboseOpt,
    app,
    check_failed,
    choices,
    emit,
    run_cli,
)
from dghard_cli.sweeping.defaults import DEFAULT_BUDGET, DEFAULT_MIN_TARGET_RETENTION

SWEEP_EPILOG = """
**Examples**

    dghard sweep BASE FT OUT --lm-eval gsm8k,arc_challenge,medqa_4options --target medqa_4options --budget 8

    dghard sweep BASE FT OUT --eval './my_eval.sh {model} {output}' --candidates configs/sweep-default.yaml --fail-under 70

    dghard sweep BASE FT_A OUT --merge-ft FT_B --eval './my_eval.sh {model} {output}'   # merge methods

    dghard sweep BASE FT OUT --eval './my_eval.sh {model} {output}' --budget 32 --refine groups

    dghard sweep BASE FT OUT --lm-eval gsm8k --budget 32 --devices 0,1,2,3   # 4 at a time, one GPU each

    dghard sweep BASE FT OUT --lm-eval gsm8k --budget 32 --executor ray --ray-address auto --eval-resources gpu=1 --jobs 16

The template runs through the shell; {model} and {output} become shell-quoted paths (do not
quote them yourself), {device} the evaluation's GPU (--devices), {split} 'val' while choosing and
'test' for one held-out evaluation of BASE, FT and the winner after the choice. {output} does not exist yet:
write a results JSON file there or a directory with lm-evaluation-harness results*.json. Without
{output}, print the JSON on stdout. The evaluated set and the winner do not depend on --jobs or
the executor. An interrupted sweep resumes when the same command is run again. With --json, the
report goes to stdout and the progress to stderr, one JSON object per line.
"""


def _split(values: list[str] | None) -> list[str]:
    out: list[str] = []
    for v in values or []:
        out += [x.strip() for x in v.split(",") if x.strip()]
    return out


@app.command("sweep", epilog=SWEEP_EPILOG)
def sweep_cmd(
    base: Annotated[str, typer.Argument(help="Base checkpoint: a directory or a Hub id org/name.")],
    ft: Annotated[
        str,
        typer.Argument(
            help="Fine-tuned checkpoint, or a PEFT LoRA adapter of BASE: a directory or a Hub id."
        ),
    ],
    out: Annotated[
        Path, typer.Argument(help="Output directory: the winner's checkpoint and sweep_report.json.")
    ],
    eval_cmd: Annotated[
        Optional[str],
        typer.Option(
            "--eval",
            help="Evaluation command template with {model} (checkpoint directory) and {output} (where to write results).",
            show_default=False,
        ),
    ] = None,
    lm_eval: Annotated[
        Optional[list[str]],
        typer.Option(
            "--lm-eval",
            help="Evaluate with lm-evaluation-harness on these tasks instead of --eval; repeatable or a,b.",
            show_default=False,
        ),
    ] = None,
    lm_eval_args: Annotated[
        Optional[str],
        typer.Option(
            "--lm-eval-args",
            help="More lm_eval options, e.g. '--batch_size auto --num_fewshot 5 --include_path DIR'.",
            show_default=False,
        ),
    ] = None,
    lm_eval_model: Annotated[
        Optional[str],
        typer.Option(
            "--lm-eval-model", metavar="hf|vllm", help="lm-eval backend (default hf).", show_default=False
        ),
    ] = None,
    target: Annotated[
        Optional[list[str]],
        typer.Option("--target", help="A benchmark the fine-tune was for (scored apart); repeatable or a,b."),
    ] = None,
    budget: Annotated[
        int, typer.Option(help="Evaluations in all, BASE's and FT's included (given results do not count).")
    ] = DEFAULT_BUDGET,
    candidates: Annotated[
        Optional[Path],
        typer.Option(help="Candidate families (YAML; default: the built-in sweep-default.yaml)."),
    ] = None,
    base_results: Annotated[
        Optional[Path], typer.Option(help="Evaluation results of BASE (skips its evaluation).")
    ] = None,
    ft_results: Annotated[
        Optional[list[Path]],
        typer.Option(
            help="Evaluation results of FT (then of each --merge-ft, in order); skips those evaluations."
        ),
    ] = None,
    merge_ft: Annotated[
        Optional[list[str]],
        typer.Option(
            "--merge-ft",
            help="Another fine-tune of BASE (repeatable): the sweep then tries merge methods of all fine-tunes.",
        ),
    ] = None,
    eval_timeout: Annotated[
        Optional[float], typer.Option(help="Seconds one evaluation may take (default: no limit).")
    ] = None,
    min_target_retention: Annotated[
        Optional[float],
        typer.Option(
            help="Every --target must keep at least this % of the fine-tune's gain "
            f"(default {DEFAULT_MIN_TARGET_RETENTION:g} with one fine-tune; none with --merge-ft).",
            show_default=False,
        ),
    ] = None,
    fail_under: Annotated[
        Optional[float],
        typer.Option(
            help="Exit 1 when the winner's --objective (HM by default) is below this (or there is no winner)."
        ),
    ] = None,
    margin: Annotated[
        Optional[float],
        typer.Option(
            help="Points within which FT counts as unchanged (default: max(0.5, 2 x combined stderr))."
        ),
    ] = None,
    metric: Annotated[
        Optional[list[str]],
        typer.Option(help="lm-eval metric for every task (acc, acc_norm, ...) or TASK=NAME; repeatable."),
    ] = None,
    units: Annotated[
        str,
        typer.Option(
            "--units",
            metavar="auto|fraction|points",
            help="How results are read: auto (per benchmark: a value in [0, 1] is a fraction), fraction "
            "or points (give points when a score below 1 point is possible, e.g. a merge that keeps "
            "little of an expert's skill).",
        ),
    ] = "auto",
    objective: Annotated[
        str,
        typer.Option(
            "--objective",
            metavar="hm|retention|normalised-accuracy",
            help="What the search maximises: hm (of % repair of what the fine-tune damaged and % retention "
            "of what it gained), retention (the gains alone), or normalised-accuracy (the merging "
            "literature's: each improved benchmark's score as a % of its fine-tune's, averaged; the "
            "base's old abilities are reported, not weighed).",
        ),
    ] = "hm",
    tie_tolerance: Annotated[
        float,
        typer.Option(
            help="Candidates within this many points of the best --objective tie with it (beside --tie-rule); the declared prior picks among them."
        ),
    ] = 0.0,
    tie_rule: Annotated[
        float,
        typer.Option(
            help="Candidates within this many standard errors of their paired difference from the best tie with it; the declared prior picks among them (the data-free default, else the middle of the family with most tied candidates). 0: only --tie-tolerance."
        ),
    ] = 2.0,
    refine: Annotated[
        Optional[list[str]],
        typer.Option(
            "--refine",
            help="groups: after the lines family's (α, β) search, a coordinate search on per-group strengths (embeddings, block ranges, head) while the budget lasts.",
        ),
    ] = None,
    jobs: Annotated[
        Optional[int],
        typer.Option(
            "--jobs",
            help="Candidates written and evaluated at a time (default 1, or one per --devices entry); "
            "the evaluated set and the winner do not depend on it.",
            show_default=False,
            rich_help_panel="Execution",
        ),
    ] = None,
    devices: Annotated[
        Optional[list[str]],
        typer.Option(
            "--devices",
            help="GPUs for the evaluations, e.g. 0,1,2,3: each running evaluation gets one "
            "(CUDA_VISIBLE_DEVICES, and {device} in --eval).",
            show_default=False,
            rich_help_panel="Execution",
        ),
    ] = None,
    executor: Annotated[
        str,
        typer.Option(
            "--executor",
            help="local (this machine) or ray (each write-and-evaluate a Ray task; pip install 'dghard[ray]').",
            rich_help_panel="Execution",
        ),
    ] = "local",
    ray_address: Annotated[
        Optional[str],
        typer.Option(
            "--ray-address",
            help="Ray cluster to use (auto, HOST:PORT or ray://HOST:PORT; default: a local one).",
            show_default=False,
            rich_help_panel="Execution",
        ),
    ] = None,
    eval_resources: Annotated[
        Optional[str],
        typer.Option(
            "--eval-resources",
            help="Ray resources of one evaluation, e.g. gpu=1,cpu=8 (other names: custom resources).",
            show_default=False,
            rich_help_panel="Execution",
        ),
    ] = None,
    keep_candidates: Annotated[
        bool,
        typer.Option(
            "--keep-candidates",
            help="Keep every evaluated candidate in OUT/candidates/ (default: losers are deleted once scored).",
            rich_help_panel="Execution",
        ),
    ] = False,
    overwrite: OverwriteOpt = False,
    dtype: Annotated[
        Optional[str],
        typer.Option(
            metavar=choices(DTYPE_CHOICES),
            help="Output dtype of every candidate's floating tensors, as --dtype of repair and merge "
            "(default: FT's); the printed command repeats it.",
        ),
    ] = None,
    device: DeviceOpt = "auto",
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Try candidate repairs (shrinkers, strengths, WiSE-FT; merges with several fine-tunes) within
    an evaluation budget, keep the best by HM, print the command that reproduces it."""
    err = Console(stderr=True, highlight=False, soft_wrap=True)

    from dghard_cli.cli.render import json_lines, progress_printer, render_sweep

    printer = None if quiet else (json_lines(err) if json_out else progress_printer(err))

    def body() -> dict:
        from dghard_cli.io.out_path import precheck_out

        precheck_out(out, overwrite=overwrite)  # before seconds of imports
        # an evaluation given its own GPU (--devices; Ray's gpu resource) sees it as cuda:0
        from dghard_cli.sweeping.execution import ray_gpus
        from dghard_cli.sweeping.lm_eval import resolve
        from dghard_cli.sweeping.run import SweepOptions, sweep

        own_gpu = bool(devices) or (executor == "ray" and ray_gpus(eval_resources) > 0)
        eval_template, lm_eval_doc = resolve(
            eval_cmd, _split(lm_eval), lm_eval_args, lm_eval_model, device, own_gpu=own_gpu
        )
        opts = SweepOptions(
            eval_template=eval_template,
            lm_eval=lm_eval_doc,
            targets=_split(target),
            budget=budget,
            candidates=candidates,
            base_results=base_results,
            ft_results=list(ft_results or []),
            extra_fts=list(merge_ft or []),
            eval_timeout=eval_timeout,
            min_target_retention=min_target_retention,
            fail_under=fail_under,
            margin=margin,
            metric=metric,
            units=units,
            objective=objective,
            tie_tolerance=tie_tolerance,
            tie_rule=tie_rule,
            device=device,
            dtype=dtype,
            overwrite=overwrite,
            refine=_split(refine),
            jobs=jobs,
            devices=list(devices or []),
            executor=executor,
            ray_address=ray_address,
            eval_resources=eval_resources,
            keep_candidates=keep_candidates,
            argv=["dghard", *sys.argv[1:]],
            on_event=printer,
        )
        try:
            return sweep(base, ft, out, opts)
        finally:
            if printer is not None:
                printer.close()

    doc = run_cli(body, verbose=verbose)
    emit(doc, as_json=json_out, quiet=quiet, render=lambda c: render_sweep(c, doc))
    reason = None
    if doc["winner"] is None:
        reason = f"no winner: {doc['no_winner_reason']}"
    elif doc.get("gate") and not doc["gate"]["passed"]:
        reason = doc["gate"]["reason"]
    if reason:
        check_failed(reason)
