"""``dghard sweep``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.text import Text

from dghard_cli.cli.common import DeviceOpt, JsonOpt, QuietOpt, VerboseOpt, app, emit, run_cli
from dghard_cli.errors import CheckFailed
from dghard_cli.sweep.run import DEFAULT_BUDGET, DEFAULT_MIN_TARGET_RETENTION, SweepOptions, sweep

SWEEP_EPILOG = """
**Examples**

    dghard sweep BASE FT OUT --eval 'lm_eval --model hf --model_args pretrained={model} --tasks gsm8k,arc_challenge,medqa_4options --output_path {output}' --target medqa_4options --budget 8

    dghard sweep BASE FT OUT --eval './my_eval.sh {model} {output}' --candidates configs/sweep-default.yaml --fail-under 70

    dghard sweep BASE FT_A OUT --merge-ft FT_B --eval './my_eval.sh {model} {output}'   # merge methods

    dghard sweep BASE FT OUT --eval './my_eval.sh {model} {output}' --budget 32 --refine groups

The template runs through the shell; {model} and {output} become shell-quoted paths (do not
quote them yourself). {output} does not exist yet: write a results JSON file there or a
directory with lm-evaluation-harness results*.json. Without {output}, print the JSON on stdout.
An interrupted sweep resumes when the same command is run again.
"""


def _split(values: list[str] | None) -> list[str]:
    out: list[str] = []
    for v in values or []:
        out += [x.strip() for x in v.split(",") if x.strip()]
    return out


def _f(v: float | None, spec: str = ".1f") -> str:
    return "—" if v is None else f"{v:{spec}}"


def render(console: Console, doc: dict) -> None:
    from rich.table import Table

    b = doc["budget"]
    t = Table(title="dghard sweep", box=None, header_style="bold")
    for col in (
        "#",
        "candidate",
        "phase",
        "status",
        "repair %",
        "retention %",
        "HM",
        "target %",
        "dist. to FT",
        "time s",
    ):
        t.add_column(col, justify="left" if col in ("candidate", "phase", "status") else "right")
    win = doc["winner"]["order"] if doc["winner"] else None
    for r in doc["candidates"]:
        secs = sum(v for v in (r.get("seconds") or {}).values() if isinstance(v, (int, float)))
        mark = " ★" if r["order"] == win else ""
        status = r["status"] + (" (cached)" if r["cached"] else "")
        t.add_row(
            str(r["order"]),
            Text(r["name"] + mark),
            r["phase"],
            status,
            _f(r["repair"]),
            _f(r["retention"]),
            _f(r["hm"]),
            _f(r["target_retention_mean"]),
            _f(r["distance"], ".3f"),
            f"{secs:.1f}",
        )
    console.print(t)
    for r in doc["candidates"]:
        if r["status"] != "ok":
            console.print(Text(f"  #{r['order']} {r['name']}: {r['message']}"))
    console.print(
        Text(
            f"evaluations: {b['used']} of --budget {b['total']} ({b['reference_evaluations']} for the references, "
            f"{b['candidate_evaluations']} candidates; {b['from_cache']} from the cache)"
        )
    )
    w = doc["winner"]
    if w:
        console.print(
            Text(
                f"winner: {w['name']}  HM {_f(w['hm'])}  repair {_f(w['repair'])} %  retention "
                f"{_f(w['retention'])} %"
                + (f"  target {_f(w['target_retention_mean'])} %" if doc["options"]["targets"] else "")
            )
        )
        console.print(Text(f"reproduce: {w['reproduce']['command']}"))
    else:
        console.print(Text(f"no winner: {doc['no_winner_reason']}"))
    console.print(
        Text(
            f"output: {doc['output']['path']} (sweep_report.json"
            + (", " + doc["plot"] if doc.get("plot") else "")
            + ")"
        )
    )
    for warning in doc["warnings"]:
        console.print(Text(f"warning: {warning}"))
    g = doc.get("gate")
    if g:
        console.print(Text(f"gate: {'PASS' if g['passed'] else 'FAIL'}: {g['reason']}"))


def progress_printer(console: Console):
    def on_event(ev: dict) -> None:
        kind = ev["kind"]
        if kind == "info":
            console.print(Text(f"[dghard] sweep: {ev['message']}"))
        elif kind == "reference":
            if ev["source"] == "given":
                console.print(Text(f"[dghard] sweep: {ev['name']}: results from {ev['path']}"))
            else:
                how = "cached" if ev["source"] == "cached" else f"evaluated in {ev['seconds']:.1f} s"
                console.print(Text(f"[dghard] sweep: {ev['name']} {how} ({ev['benchmarks']} benchmarks)"))
        elif kind == "evaluating" and "order" not in ev:
            console.print(Text(f"[dghard] sweep: evaluating {ev['name']} ..."))
        elif kind == "candidate":
            r = ev["row"]
            head = f"[dghard] sweep {ev['order']}/{ev['budget']} {r['name']} ({r['phase']})"
            if r["status"] == "ok":
                tail = f"HM {_f(r['hm'])} (repair {_f(r['repair'])} %, retention {_f(r['retention'])} %)"
            else:
                tail = f"{r['status']}: {r['message']}"
            secs = sum(v for v in (r.get("seconds") or {}).values() if isinstance(v, (int, float)))
            when = "cached" if r["cached"] else f"{secs:.1f} s"
            console.print(Text(f"{head}: {tail} [{when}]"))

    return on_event


@app.command("sweep", epilog=SWEEP_EPILOG)
def sweep_cmd(
    base: Annotated[str, typer.Argument(help="Base checkpoint: a directory or a Hub id org/name.")],
    ft: Annotated[str, typer.Argument(help="Fine-tuned checkpoint: a directory or a Hub id.")],
    out: Annotated[
        Path, typer.Argument(help="Output directory: the winner's checkpoint and sweep_report.json.")
    ],
    eval_cmd: Annotated[
        str,
        typer.Option(
            "--eval",
            help="Evaluation command template with {model} (checkpoint directory) and {output} (where to write results).",
            show_default=False,
        ),
    ],
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
        float, typer.Option(help="Every --target must keep at least this % of the fine-tune's gain.")
    ] = DEFAULT_MIN_TARGET_RETENTION,
    fail_under: Annotated[
        Optional[float],
        typer.Option(help="Exit 1 when the winner's HM is below this (or there is no winner)."),
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
    tie_tolerance: Annotated[
        float,
        typer.Option(
            help="Candidates within this many HM points of the best are tied; the closest to FT wins."
        ),
    ] = 0.0,
    refine: Annotated[
        Optional[list[str]],
        typer.Option(
            "--refine",
            help="groups: after the lines family's (α, β) search, a coordinate search on per-group strengths (embeddings, block ranges, head) while the budget lasts.",
        ),
    ] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a non-empty OUT.")] = False,
    device: DeviceOpt = "auto",
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Try candidate repairs (shrinkers, strengths, WiSE-FT; merges with several fine-tunes) within
    an evaluation budget, keep the best by HM, print the command that reproduces it."""
    err = Console(stderr=True, highlight=False, soft_wrap=True)

    def body() -> dict:
        opts = SweepOptions(
            eval_template=eval_cmd,
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
            tie_tolerance=tie_tolerance,
            device=device,
            overwrite=overwrite,
            refine=_split(refine),
            argv=["dghard", *sys.argv[1:]],
            on_event=None if (quiet or json_out) else progress_printer(err),
        )
        return sweep(base, ft, out, opts)

    doc = run_cli(body, verbose=verbose)
    emit(doc, as_json=json_out, quiet=quiet, render=lambda c: render(c, doc))
    reason = None
    if doc["winner"] is None:
        reason = f"no winner: {doc['no_winner_reason']}"
    elif doc.get("gate") and not doc["gate"]["passed"]:
        reason = doc["gate"]["reason"]
    if reason:

        def fail() -> None:
            raise CheckFailed(reason)

        run_cli(fail, verbose=False)
