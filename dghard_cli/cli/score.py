"""``dghard score``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Optional

import typer

from dghard_cli.cli.common import JsonOpt, QuietOpt, VerboseOpt, app, check_failed, choices, emit, run_cli
from dghard_cli.errors import InputError
from dghard_cli.scoring.results import SCALES

SCORE_EPILOG = """
**Examples**

    dghard score --base eval/base.json --ft eval/ft.json --candidate eval/repaired.json

    dghard score --base lm_eval_out/base --ft lm_eval_out/ft --candidate hard=lm_eval_out/hard --candidate wise=lm_eval_out/wise --target gsm8k

    dghard score --base b.json --ft f.json --candidate r.json --fail-under 50 --report score.json

Files are lm-evaluation-harness results (a results_*.json or the directory holding it) or a
plain {"benchmark": score} JSON. Scores are compared in points (0-100).
"""


def _split(values: list[str] | None) -> list[str]:
    out: list[str] = []
    for v in values or []:
        out += [x.strip() for x in v.split(",") if x.strip()]
    return out


def _units(units: str, scale: str | None) -> str:
    """--units, or the value of its deprecated name --scale (which --scale means elsewhere:
    a multiplier of the threshold); both given must agree."""
    if scale is None:
        return units
    if units != "auto" and units != scale:
        raise InputError(
            f"--scale is the old name of --units; give one of them (got --units {units}, --scale {scale})"
        )
    return scale


@app.command("score", epilog=SCORE_EPILOG)
def score_cmd(
    base: Annotated[str, typer.Option("--base", help="Evaluation results of the base model.")],
    ft: Annotated[str, typer.Option("--ft", help="Evaluation results of the fine-tuned model.")],
    candidate: Annotated[
        list[str],
        typer.Option(
            "--candidate",
            help="Results of a candidate (repaired/merged model), PATH or NAME=PATH; repeatable.",
        ),
    ],
    target: Annotated[
        Optional[list[str]],
        typer.Option("--target", help="A benchmark the fine-tune was for (scored apart); repeatable or a,b."),
    ] = None,
    margin: Annotated[
        Optional[float],
        typer.Option(
            help="Points within which ft counts as unchanged (default: max(0.5, 2 x combined stderr))."
        ),
    ] = None,
    metric: Annotated[
        Optional[list[str]],
        typer.Option(
            help="lm-eval metric for every task (acc, acc_norm, exact_match,strict-match) or TASK=NAME; repeatable."
        ),
    ] = None,
    units: Annotated[
        str,
        typer.Option(
            "--units",
            metavar=choices(SCALES),
            help="auto (per benchmark: a fraction in [0, 1], points, or unbounded like a −NLL), fraction or points.",
        ),
    ] = "auto",
    scale: Annotated[
        Optional[str], typer.Option("--scale", hidden=True, help="Deprecated name of --units.")
    ] = None,
    subtasks: Annotated[
        bool, typer.Option("--subtasks", help="Score lm-eval leaf tasks instead of their groups.")
    ] = False,
    fail_under: Annotated[
        Optional[float],
        typer.Option(help="Exit 1 when the best candidate's HM is below this (or undefined)."),
    ] = None,
    report: Annotated[Optional[Path], typer.Option(help="Also write the JSON document to this file.")] = None,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Partition-conditioned scoring of evaluation results: % repair, % retention and their HM."""

    def body() -> dict:
        from dghard_cli.io.atomic import write_json_atomic
        from dghard_cli.io.paths import Output, check_outputs
        from dghard_cli.scoring.run import score_files

        doc = score_files(
            base,
            ft,
            candidate,
            targets=_split(target),
            margin=margin,
            metric=metric,
            scale=_units(units, scale),
            subtasks=subtasks,
            fail_under=fail_under,
        )
        if report is not None:
            rp = Path(report).expanduser()
            if not rp.parent.exists():
                raise InputError(f"--report {report}: directory {rp.parent} does not exist")
            named = [re.match(r"^([^=/\\]+)=(.+)$", c) for c in candidate]
            given = [("--base", base), ("--ft", ft)]
            given += [("--candidate", m.group(2) if m else c) for m, c in zip(named, candidate, strict=True)]
            check_outputs([(k, v) for k, v in given if v is not None], [Output("--report", rp)])
            write_json_atomic(rp, doc)
        return doc

    doc = run_cli(body, verbose=verbose)
    from dghard_cli.cli.render import render_score

    emit(doc, as_json=json_out, quiet=quiet, render=lambda c: render_score(c, doc))
    g = doc.get("gate")
    if g and not g["passed"]:
        check_failed(g["reason"])
