"""The terminal output of ``dghard audit-lora``: the findings grouped by level and code (a few
per code unless ``--verbose``), the per-module table with ``--verbose``, and the summary line.

Takes the audit document (a dict) and prints it with rich; relies on nothing else.
:mod:`dghard_cli.cli.render` is the public entry.
"""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

# -- audit ---------------------------------------------------------------------------------------


LEVEL_STYLE = {"error": "bold red", "warn": "yellow", "info": "cyan"}
#: Findings of one code shown before the rest are summarised (all with --verbose).
SHOW_PER_CODE = 4


def _fmt_audit(x: object, spec: str = ".3g") -> str:
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
                _fmt_audit(r.get("scaling")),
                _fmt_audit(r.get("delta_norm")),
                _fmt_audit(base.get("relative_norm")),
                _fmt_audit(r.get("effective_rank"), ".2f"),
                _fmt_audit(r.get("top_share"), ".2f"),
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
