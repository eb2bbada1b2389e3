"""``dghard audit-lora``."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from dghard_cli.cli.common import DeviceOpt, JsonOpt, QuietOpt, VerboseOpt, app, emit, run_cli

AUDIT_EPILOG = """
**Examples**

    dghard audit-lora ./my-adapter                       # table of findings, exit 0/1

    dghard audit-lora org/some-adapter --base Qwen/Qwen2.5-7B --fail-on warn --json > audit.json

    dghard audit-lora ./my-adapter --base ./base --top-k 0      # skip intruder dimensions

Exit codes: 0 no finding at or above --fail-on; 1 there is one; 2 unreadable input.
"""

LEVEL_STYLE = {"error": "bold red", "warn": "yellow", "info": "cyan"}
#: Findings of one code shown before the rest are summarised (all with --verbose).
SHOW_PER_CODE = 4


def _fmt(x: object, spec: str = ".3g") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def render_findings(console: Console, doc: dict, verbose: bool) -> None:
    findings = doc["findings"]
    if findings:
        t = Table(show_header=True, header_style="bold", box=box.SIMPLE_HEAD, show_edge=False)
        t.add_column("level", no_wrap=True)
        t.add_column("code", no_wrap=True)
        t.add_column("module", overflow="fold", min_width=16, max_width=40)
        t.add_column("finding", overflow="fold")
        groups: dict[tuple[str, str], list[dict]] = {}
        for f in findings:
            groups.setdefault((f["level"], f["code"]), []).append(f)
        last_level = None
        for (level, code), items in groups.items():
            if last_level is not None and level != last_level:
                t.add_section()
            last_level = level
            shown = items if verbose or len(items) <= SHOW_PER_CODE else items[: SHOW_PER_CODE - 1]
            for f in shown:
                t.add_row(
                    Text(level, style=LEVEL_STYLE[level]),
                    Text(code),
                    Text(f["module"] or "-"),
                    Text(f["message"]),
                )
            if len(shown) < len(items):
                t.add_row(
                    Text(level, style=LEVEL_STYLE[level]),
                    Text(code),
                    Text(f"… {len(items) - len(shown)} more"),
                    Text("same finding for more modules (--verbose or --json lists them)"),
                )
        console.print(t)
    if verbose and doc["modules"]:
        m = Table(show_header=True, header_style="bold", box=None, pad_edge=False, title="modules")
        for col in ("module", "rank", "scaling", "‖ΔW‖", "‖ΔW‖/‖W‖", "eff. rank", "top share", "intruders"):
            if col == "module":
                m.add_column(col, overflow="fold", min_width=28)
            else:
                m.add_column(col, justify="right")
        for r in doc["modules"]:
            base = r.get("base") or {}
            intr = r.get("intruders")
            m.add_row(
                Text(r["module"]),
                str(r["rank"]),
                _fmt(r.get("scaling")),
                _fmt(r.get("delta_norm")),
                _fmt(base.get("relative_norm")),
                _fmt(r.get("effective_rank"), ".2f"),
                _fmt(r.get("top_share"), ".2f"),
                f"{intr['count']}/{intr['k']}" if intr else "-",
            )
        console.print(m)
    console.print(Text(summary_line(doc)))


def summary_line(doc: dict) -> str:
    s = doc["summary"]
    c = doc["config"]
    extras = "".join(
        f" {name}" for name, on in (("rsLoRA", c.get("use_rslora")), ("DoRA", c.get("use_dora"))) if on
    )
    alpha = c.get("lora_alpha")
    alpha_s = "?" if alpha is None else f"{alpha:g}"

    def plural(n: int, word: str) -> str:
        return f"{n} {word}{'' if n == 1 else 's'}"

    base = f" vs {doc['base']['source']}" if doc.get("base") else ""
    return (
        f"audit-lora {doc['adapter']['source']}{base}: {plural(s['modules'], 'module')}, r={c['r']} "
        f"alpha={alpha_s}{extras}; {plural(s['errors'], 'error')}, {plural(s['warnings'], 'warning')}, "
        f"{s['infos']} info -> {s['verdict']} (--fail-on {doc['parameters']['fail_on']}), "
        f"{doc['timings'].get('total_s', 0):.2f} s"
    )


@app.command("audit-lora", epilog=AUDIT_EPILOG)
def audit_lora_cmd(
    adapter: Annotated[str, typer.Argument(help="PEFT LoRA adapter: a directory or a Hub id org/name.")],
    base: Annotated[
        Optional[str],
        typer.Option(
            help="Base checkpoint (directory or Hub id): check the declared base, module shapes, the "
            "update's size against the base weights, and intruder dimensions. Streamed one tensor at a time."
        ),
    ] = None,
    revision: Annotated[Optional[str], typer.Option(help="Hub revision of ADAPTER.")] = None,
    base_revision: Annotated[Optional[str], typer.Option(help="Hub revision of BASE.")] = None,
    fail_on: Annotated[
        str, typer.Option("--fail-on", help="Exit 1 when a finding reaches this level: error, warn or info.")
    ] = "error",
    top_k: Annotated[
        int,
        typer.Option(
            "--top-k",
            help="Intruder dimensions: how many top singular vectors of W_base + ΔW to test (0 skips).",
        ),
    ] = 10,
    epsilon: Annotated[
        float,
        typer.Option(
            "--epsilon",
            help="Intruder dimensions: a top vector whose best |cosine| with every base singular vector is below this is an intruder.",
        ),
    ] = 0.5,
    device: DeviceOpt = "auto",
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Audit a PEFT LoRA adapter: config, tensor set, shapes, NaN/zero factors, spectra; with --base,
    the base identity, shapes and intruder dimensions."""
    from dghard_cli.audit.auditor import audit_lora

    def body() -> dict:
        return audit_lora(
            adapter,
            base,
            fail_on=fail_on.strip().lower(),
            k=top_k,
            eps=epsilon,
            revision=revision,
            base_revision=base_revision,
            device=device,
            progress=not (quiet or json_out),
        )

    doc = run_cli(body, verbose=verbose)
    emit(doc, as_json=json_out, quiet=quiet, render=lambda c: render_findings(c, doc, verbose))
    if doc["summary"]["failed"]:
        raise typer.Exit(1)
