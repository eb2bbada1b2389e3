"""The terminal output of ``dghard score``: the benchmarks and their partitions, one table per
candidate, the ranking, warnings and the gate.

Takes the score document (a dict) and prints it with rich; relies on nothing else.
:mod:`dghard_cli.cli.render` is the public entry.
"""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

# -- score ---------------------------------------------------------------------------------------


def _fmt_score(v: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "—" if v is None else f"{v:{spec}}{suffix}"


def _pm(v: float | None, se: float | None, spec: str = ".1f", suffix: str = "") -> str:
    """``v ± se`` (the value alone where its standard error is unknown)."""
    if v is None or se is None:
        return _fmt_score(v, spec, suffix)
    return f"{v:{spec}} ± {se:{spec}}{suffix}"


def render_score(console, doc: dict) -> None:
    """Tables for the terminal: benchmarks and partitions, one per candidate, the ranking."""

    own = any(g["unit"] == "unbounded" for g in doc.get("units_assumed", []))
    title = "benchmarks (points; unbounded scores in their own units)" if own else "benchmarks (points)"
    t = Table(title=title, box=None, header_style="bold")
    for col in ("benchmark", "base", "ft", "ft − base", "margin", "partition"):
        t.add_column(col, justify="left" if col in ("benchmark", "partition") else "right")
    for bm in doc["benchmarks"]:
        se_b = f" ± {bm['base_stderr']:.2f}" if bm["base_stderr"] is not None else ""
        se_f = f" ± {bm['ft_stderr']:.2f}" if bm["ft_stderr"] is not None else ""
        t.add_row(
            Text(bm["name"]),
            f"{bm['base']:.2f}{se_b}",
            f"{bm['ft']:.2f}{se_f}",
            f"{bm['ft_change']:+.2f}",
            f"{bm['margin']:.2f}",
            bm["partition"],
        )
    console.print(t)
    for g in doc.get("units_assumed", []):
        other = "".join(
            f"; in {where}: " + ", ".join(f"{k} {u}" for k, u in units.items())
            for where, units in g.get("other_files", {}).items()
        )
        console.print(Text(f"units: {g['unit']}: {', '.join(g['benchmarks'])} ({g['assumed']}{other})"))
    label = {"damaged": "repair", "improved": "retention", "unchanged": "change", "target": "target"}
    for cd in doc["candidates"]:
        ct = Table(title=f"candidate {cd['name']}", box=None, header_style="bold")
        for col in ("benchmark", "partition", "score", "vs ft", "vs base", "per-benchmark"):
            ct.add_column(col, justify="left" if col in ("benchmark", "partition") else "right")
        own_units = {bm["name"] for bm in doc["benchmarks"] if bm.get("unit") == "unbounded"}
        for r in cd["benchmarks"]:
            unit = (" pt" if r["name"] not in own_units else "") if r["partition"] == "unchanged" else " %"
            ct.add_row(
                Text(r["name"]),
                r["partition"],
                f"{r['value']:.2f}",
                f"{r['vs_ft']:+.2f}",
                f"{r['vs_base']:+.2f}",
                f"{label[r['partition']]} {_fmt_score(r['score'], {' %': '.1f', ' pt': '+.1f'}.get(unit, '+.3g'), unit)}",
            )
        console.print(ct)
        console.print(
            Text(
                f"  HM {_pm(cd['hm'], cd.get('hm_stderr'))}   repair {_pm(cd['repair'], cd.get('repair_stderr'), '.1f', ' %')}"
                f"   retention {_pm(cd['retention'], cd.get('retention_stderr'), '.1f', ' %')}"
            )
        )
        line = f"  unchanged {_fmt_score(cd['unchanged_mean_change'], '+.2f', ' pt')}"
        if doc["targets"]:
            line += f"   target retention {_fmt_score(cd['target_retention_mean'], '.1f', ' %')}"
        console.print(Text(line))
        console.print()
    if len(doc["candidates"]) > 1:
        rt = Table(title="ranking", box=None, header_style="bold")
        for col in ("rank", "candidate", "HM", "repair %", "retention %", "unchanged pt", "target %"):
            rt.add_column(col, justify="left" if col == "candidate" else "right")
        by_name = {c["name"]: c for c in doc["candidates"]}
        for i, n in enumerate(doc["ranking"], 1):
            cd = by_name[n]
            rt.add_row(
                str(i),
                Text(n),
                _pm(cd["hm"], cd.get("hm_stderr")),
                _fmt_score(cd["repair"], ".1f"),
                _fmt_score(cd["retention"], ".1f"),
                _fmt_score(cd["unchanged_mean_change"], "+.2f"),
                _fmt_score(cd["target_retention_mean"], ".1f"),
            )
        console.print(rt)
    for w in doc["warnings"]:
        console.print(Text(f"warning: {w}"))
    g = doc.get("gate")
    if g:
        console.print(Text(f"gate: {'PASS' if g['passed'] else 'FAIL'}: {g['reason']}"))
