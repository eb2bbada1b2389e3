"""Every table and line ``dghard`` prints on a terminal (rich), one section per command.

The library returns documents (dicts); the commands in :mod:`dghard_cli.cli` hand them to these
functions. Nothing outside ``dghard_cli.cli`` imports rich. Over ~400 lines because it is one
screen per command, kept together so the output of all commands can be read (and kept
consistent) in one place.
"""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from dghard_cli.methods import registry
from dghard_cli.report import plots

# -- report --------------------------------------------------------------------------------------


def summary_table(report: dict):
    """A short rich table for the terminal."""

    s = report["summary"]
    t = Table(title=f"dghard {report['command']}: {report['method']}", show_header=False, box=None)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("tensors", f"{s['tensors']} (" + ", ".join(f"{k} {v}" for k, v in s["actions"].items()) + ")")
    if s.get("energy_kept") is not None:
        t.add_row("energy kept", f"{100 * s['energy_kept']:.1f} % of ‖Δ‖²")
        t.add_row("rank kept", f"median {s['rank_kept_median']:g}, max {s['rank_kept_max']}")
        t.add_row("noise bulk", f"{s['bulk_found_tensors']} of {s['method_tensors']} matrices")
    if s.get("low_rank_tensors"):
        t.add_row("low-rank", f"{s['low_rank_tensors']} matrices kept as fine-tuned")
    if report.get("layer_strengths"):  # --lines / --layer-strengths (methods/schedule.py)
        t.add_row("λ per layer", report["layer_strengths"]["summary"])
    tm = report.get("timings", {})
    if "total" in tm:
        t.add_row("time", f"{tm['total']:.1f} s")
    mem = report.get("peak_memory", {})
    if "rss_bytes" in mem:
        t.add_row("peak RSS", f"{mem['rss_bytes'] / 2**20:.0f} MiB")
    if report.get("output"):
        t.add_row("output", str(report["output"].get("path")))
        if report["output"].get("resumed"):
            t.add_row(
                "resumed",
                f"{report['output']['resumed_tensors']} of {s['tensors']} tensors were already written "
                "by an interrupted run",
            )
    if s.get("verdict"):
        t.add_row("verdict", s["verdict"])
    for w in s.get("warnings", []):
        t.add_row("warning", w)
    return t


# -- inspect -------------------------------------------------------------------------------------


def short_name(name: str) -> str:
    """``model.layers.0.mlp.up_proj.weight`` -> ``layers.0.mlp.up_proj`` for narrow tables."""
    name = name[len("model.") :] if name.startswith("model.") else name
    return name[: -len(".weight")] if name.endswith(".weight") else name


def render_inspect(console, doc: dict, *, limit: int = 30) -> None:
    """The summary table and a per-matrix table (the ``limit`` largest ‖Δ‖ when there are more)."""

    console.print(summary_table(doc))
    rows = [r for r in doc["tensors"] if plots.analysed(r)]
    shown = rows
    if len(rows) > limit:
        shown = sorted(rows, key=lambda r: -(r.get("delta_norm") or 0.0))[:limit]
        shown.sort(key=rows.index)
    t = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("tensor", "shape", "rank", "energy", ">edge", "KS", "slope", "note"):
        t.add_column(col, justify="left" if col in ("tensor", "note") else "right", no_wrap=col != "note")

    def f(v, spec=".3g"):
        return "—" if v is None else f"{v:{spec}}"

    for r in shown:
        note = r.get("reason") or ("bulk" if r.get("bulk") else "no bulk")
        t.add_row(
            Text(short_name(r["name"])),
            "×".join(map(str, r["shape"])),
            f(r.get("rank_kept"), "d"),
            "—" if r.get("energy_kept") is None else f"{100 * r['energy_kept']:.1f}%",
            "—" if r.get("share_above_mp_edge") is None else f"{100 * r['share_above_mp_edge']:.1f}%",
            f(r.get("ks_distance"), ".3f"),
            f(r.get("powerlaw_slope"), ".2f"),
            note,
        )
    console.print(t)
    if len(rows) > len(shown):
        console.print(Text(f"({len(rows) - len(shown)} more matrices: --json or --html for all)"))
    for key in ("plots", "html"):
        if key in doc:
            where = doc[key]["dir"] if key == "plots" else doc[key]
            n = f" ({len(doc['plots']['files'])} files)" if key == "plots" else ""
            console.print(Text(f"{key}: {where}{n}"))


# -- score ---------------------------------------------------------------------------------------


def _fmt_score(v: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "—" if v is None else f"{v:{spec}}{suffix}"


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
                f"  HM {_fmt_score(cd['hm'], '.1f')}   repair {_fmt_score(cd['repair'], '.1f', ' %')}"
                f"   retention {_fmt_score(cd['retention'], '.1f', ' %')}"
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
                _fmt_score(cd["hm"], ".1f"),
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


# -- merge ---------------------------------------------------------------------------------------


def render_merge(console: Console, doc: dict) -> None:

    console.print(summary_table(doc))
    m = doc.get("merge", {})
    p = doc.get("parameters", {})
    t = Table(show_header=False, box=None)
    t.add_column(style="bold")
    t.add_column()
    shown = {
        q.name: p[q.name]
        for q in registry.params().values()
        if (q.scalar or q.kind == registry.BOOL) and q.name in p
    }
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
    if "spherical_tensors" in m:
        t.add_row(
            "slerp", f"{m['spherical_tensors']} tensors spherical, {m['linear_tensors']} linear (colinear)"
        )
    if m.get("median_stock_t") is not None:
        t.add_row("model stock", f"median t = {m['median_stock_t']:.4f}")
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


# -- repair --------------------------------------------------------------------------------------


def render_plan(console: Console, doc: dict, verbose: bool) -> None:

    s = doc["summary"]
    console.print(
        Text(
            f"dry run: {doc['output']['path']} would get {s['tensors']} tensors in "
            f"{doc['output']['shards']} shard(s), {doc['output']['bytes'] / 1e6:.1f} MB"
        )
    )
    t = Table(show_header=True, box=None)
    t.add_column("action")
    t.add_column("tensors", justify="right")
    for k, v in s["actions"].items():
        t.add_row(k, str(v))
    console.print(t)
    for note in doc.get("notes", []):
        console.print(Text(f"note: {note}"))
    lam = bool(doc.get("layer_strengths"))  # --lines / --layer-strengths (methods/schedule.py)
    if lam:
        console.print(Text(f"λ per layer: {doc['layer_strengths']['summary']}"))
    if verbose:
        t = Table(show_header=True, box=None)
        for col in ("name", "shape", "dtype", "action", "shard", *(["λ"] if lam else [])):
            t.add_column(col, overflow="fold")
        for r in doc["tensors"]:
            t.add_row(
                Text(r["name"]),
                str(r["shape"]),
                r["dtype"],
                r["action"] + (f" ({r['reason']})" if r.get("reason") else ""),
                Text(r["shard"]),
                *([_lam(r)] if lam else []),
            )
        console.print(t)


def _lam(rec: dict) -> str:
    """A tensor's λ and its place (embed, block index, head), or a dash when it is not scheduled."""
    if rec.get("layer_strength") is None:
        return "—"
    return f"{rec['layer_strength']:.4g} ({rec['layer']})"


def render_report(console: Console, doc: dict) -> None:

    console.print(summary_table(doc))


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


# -- verify ----------------------------------------------------------------------------------------


def render_verify(console: Console, directory, doc: dict) -> None:
    skipped = f"; not checked: {', '.join(doc['skipped'])}" if doc.get("skipped") else ""
    console.print(
        Text(
            f"{directory}: OK — {doc['tensors']} tensors in {doc['shards']} shard(s), "
            f"{doc['bytes'] / 1e6:.1f} MB; checked {', '.join(doc['checks'])}{skipped}"
        )
    )


# -- adapter outputs (repair/merge --format peft) ---------------------------------------------------


def is_adapter_doc(doc: dict) -> bool:
    """A repair or merge document of an adapter output (rendered by :func:`render_adapter`)."""
    return (doc.get("output") or {}).get("format") == "peft"


def render_adapter(console: Console, doc: dict) -> None:
    """The summary of an adapter output."""
    a = doc.get("adapter", {})
    out = doc["output"]
    if out.get("dry_run"):
        s = doc["summary"]
        route = doc["parameters"].get("adapter_route")
        console.print(
            Text(
                f"dry run: {out['path']} would get a PEFT LoRA adapter ({route} route) from {s['tensors']} "
                f"tensors; the full checkpoint would be {out['full_checkpoint_bytes'] / 1e6:.1f} MB"
            )
        )
        for note in doc.get("notes", []):
            console.print(Text(f"note: {note}"))
        return
    t = Table(show_header=False, box=None)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("output", Text(f"{out['path']} (PEFT LoRA adapter, {a.get('route')} route)"))
    t.add_row(
        "modules",
        f"{a.get('lora_modules', 0)} low-rank (rank median {a.get('rank_median')}, max {a.get('rank_max')}), "
        f"{a.get('full_tensors', 0)} full tensors",
    )
    if a.get("modules_to_save"):
        t.add_row("modules_to_save", Text(", ".join(a["modules_to_save"])))
    if doc.get("layer_strengths"):  # --lines / --layer-strengths: B scaled per block
        t.add_row("λ per layer", doc["layer_strengths"]["summary"])
    size, full = a.get("bytes") or 0, a.get("full_checkpoint_bytes") or 0
    ratio = f" ({100 * size / full:.2f} % of the {full / 1e6:.1f} MB full checkpoint)" if full else ""
    t.add_row("size", f"{size / 1e6:.2f} MB{ratio}")
    t.add_row(
        "energy lost",
        f"{a.get('energy_lost_max', 0.0):.3g} (largest share of a module's update cut by the rank limit: "
        f"{a.get('rank_cap') or 'none'})",
    )
    t.add_row("time", f"{doc['timings'].get('total', 0.0):.1f} s")
    console.print(t)
    verdict = (doc.get("summary") or {}).get("verdict")
    if verdict:
        console.print(Text(f"verdict: {verdict}"))
    for w in (doc.get("summary") or {}).get("warnings", []):
        console.print(Text(f"warning: {w}"))
