"""The terminal output of ``dghard sweep``: the candidates table, the budget, the winner and
its reproduction command, and the per-event progress lines printed while the sweep runs.

Takes the sweep document (a dict) or progress events and prints them with rich; relies on
nothing else. :mod:`dghard_cli.cli.render` is the public entry.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

# -- sweep ---------------------------------------------------------------------------------------


def _fmt_sweep(v: float | None, spec: str = ".1f") -> str:
    return "—" if v is None else f"{v:{spec}}"


def render_sweep(console: Console, doc: dict) -> None:

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
        if r["status"] == "ok" and r.get("feasible") is False:
            status += " (below target bar)"
        t.add_row(
            str(r["order"]),
            Text(r["name"] + mark),
            r["phase"],
            status,
            _fmt_sweep(r["repair"]),
            _fmt_sweep(r["retention"]),
            _fmt_sweep(r["hm"]),
            _fmt_sweep(r["target_retention_mean"]),
            _fmt_sweep(r["distance"], ".3f"),
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
                f"winner: {w['name']}  HM {_fmt_sweep(w['hm'])}  repair {_fmt_sweep(w['repair'])} %  retention "
                f"{_fmt_sweep(w['retention'])} %"
                + (
                    f"  target {_fmt_sweep(w['target_retention_mean'])} %"
                    if doc["options"]["targets"]
                    else ""
                )
            )
        )
        console.print(Text(f"reproduce: {w['reproduce']['command']}"))
        if w["reproduce"].get("out"):
            console.print(
                Text(
                    f"  (writes a copy to {w['reproduce']['out']}: {doc['output']['path']} already holds "
                    "this checkpoint)"
                )
            )
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
    for note in doc.get("notes", []):
        console.print(Text(f"note: {note}"))
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
                tail = f"HM {_fmt_sweep(r['hm'])} (repair {_fmt_sweep(r['repair'])} %, retention {_fmt_sweep(r['retention'])} %)"
                if r.get("feasible") is False:
                    worst = min(
                        (v for v in (r.get("target_retention") or {}).values() if v is not None), default=None
                    )
                    bar = ev.get("min_target_retention")
                    tail += f"; cannot win: target retention {_fmt_sweep(worst)} % is below" + (
                        f" --min-target-retention {bar:g} %" if bar is not None else " the bar"
                    )
            else:
                tail = f"{r['status']}: {r['message']}"
            secs = sum(v for v in (r.get("seconds") or {}).values() if isinstance(v, (int, float)))
            when = "cached" if r["cached"] else f"{secs:.1f} s"
            console.print(Text(f"{head}: {tail} [{when}]"))

    return on_event
