"""The terminal output of the commands that read or write a checkpoint: the report summary
table (repair, merge, inspect), the inspect per-matrix table, the merge details, the repair and
merge dry-run plan, verify's line, and the summary of an adapter output (``--format peft``).

Each function takes the document the library returned (a dict) and prints it with rich; it
relies on the method registry (which merge parameters to show) and on
:func:`dghard_cli.report.plots.analysed` (which inspect rows are matrices).
:mod:`dghard_cli.cli.render` is the public entry.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from dghard_cli.methods import registry
from dghard_cli.report import plots
from dghard_cli.report.build import VARIES

# -- report --------------------------------------------------------------------------------------


def summary_table(report: dict):
    """A short rich table for the terminal."""

    s = report["summary"]
    title = f"dghard {report['command']}: {report['method']}"
    # a table narrower than its title wraps the title: as wide as the title at least
    t = Table(title=title, show_header=False, box=None, min_width=len(title))
    t.add_column(style="bold")
    t.add_column()
    t.add_row("tensors", f"{s['tensors']} (" + ", ".join(f"{k} {v}" for k, v in s["actions"].items()) + ")")
    if s.get("energy_kept") is not None:
        t.add_row("energy kept", f"{100 * s['energy_kept']:.1f} % of ‖Δ‖²")
        t.add_row("rank kept", f"median {s['rank_kept_median']:g}, max {s['rank_kept_max']}")
        t.add_row("noise bulk", f"{s['bulk_found_tensors']} of {s['method_tensors']} matrices")
    if s.get("low_rank_tensors"):
        t.add_row("low-rank", f"{s['low_rank_tensors']} matrices kept as fine-tuned")
    if report.get("layer_strengths"):  # --lines / --layer-strengths (dghard_cli/schedule/)
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
        varies = set(p.get("varies_per_tensor", ()))
        t.add_row(
            "parameters",
            ", ".join(f"{k}={VARIES if k in varies else v}" for k, v in shown.items()),
        )
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
    lam = bool(doc.get("layer_strengths"))  # --lines / --layer-strengths (dghard_cli/schedule/)
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


# -- verify ----------------------------------------------------------------------------------------


def render_verify(console: Console, directory, doc: dict) -> None:
    skipped = f"; not checked: {', '.join(doc['skipped'])}" if doc.get("skipped") else ""
    if doc.get("kind") == "peft-lora":
        console.print(
            Text(
                f"{directory}: OK — PEFT adapter, {doc['modules']} LoRA modules, {doc['tensors']} tensors, "
                f"{doc['bytes'] / 1e6:.2f} MB; checked {', '.join(doc['checks'])}{skipped}"
            )
        )
        return
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
    core = doc["parameters"].get("core_space_merge")
    if core:  # --core-space: say which merge the cores got
        what = (
            "the same merge as on the full tensors"
            if core == "lossless"
            else f"{doc.get('method')} of the cores (Core Space), not {doc.get('method')} of the full tensors"
        )
        t.add_row("core space", Text(what))
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
    if a.get("exact", True):
        fidelity = "exact (every module keeps its whole update)"
    else:
        fidelity = (
            f"LOSSY, asked for by {a.get('cut_by')}: keeps {100 * a.get('energy_kept', 0.0):.1f} % of the "
            f"update's energy ({a.get('lossy_modules')} modules cut; --merge writes the exact model)"
        )
    t.add_row("adapter", fidelity)
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
