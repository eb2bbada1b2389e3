"""One self-contained HTML page for a spectral report (``inspect`` or a finished ``repair``).

The page holds the verdict, the summary numbers, the heat maps of rank and energy kept, the
per-matrix spectra when the document carries them (``inspect``), and the per-matrix table.
Images are PNGs embedded as base64 ``data:`` URIs, so the file can be opened from a CI
artifact with nothing beside it.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

import numpy as np

from dghard_cli.errors import InputError
from dghard_cli.io.atomic import write_text_atomic
from dghard_cli.report import plots

CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 2em auto; max-width: 1200px;
       color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; }
h2 { font-size: 1.15em; margin-top: 1.8em; border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }
.verdict { background: #f4f7fb; border-left: 4px solid #4a78a8; padding: 0.7em 1em; font-size: 1.05em; }
.warning { background: #fdf3e7; border-left: 4px solid #d9822b; padding: 0.5em 1em; margin: 0.4em 0; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { padding: 0.25em 0.6em; border-bottom: 1px solid #eee; text-align: right; }
th { background: #fafafa; position: sticky; top: 0; }
td.name, th.name { text-align: left; font-family: ui-monospace, monospace; }
table.summary td:first-child { text-align: left; font-weight: 600; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
.meta { color: #666; font-size: 0.85em; }
"""

TABLE_COLUMNS = [
    ("shape", "shape"),
    ("delta_norm", "‖Δ‖_F"),
    ("median_sv", "median σ"),
    ("noise_level", "noise ŝ"),
    ("tau", "τ"),
    ("spikes", "spikes"),
    ("rank_kept", "rank kept"),
    ("energy_kept", "energy kept"),
    ("share_above_mp_edge", "above MP edge"),
    ("ks_distance", "KS to MP"),
    ("powerlaw_slope", "log-log slope"),
    ("bulk", "noise bulk"),
    ("lora_like", "LoRA-like"),
    ("action", "action"),
]


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


def _num(v: object, spec: str = ".4g") -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, float)):
        return f"{v:{spec}}"
    return str(v)


def pct(v: float | None) -> str:
    """How the page writes a share (0.777 -> '77.7 %')."""
    return "—" if v is None else f"{100 * v:.1f} %"


def _img(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{_e(alt)}" src="data:image/png;base64,{data}">'


def _cell(rec: dict, key: str) -> str:
    if key == "shape":
        return "×".join(str(d) for d in rec["shape"])
    if key == "energy_kept":
        return pct(rec.get(key))
    if key == "share_above_mp_edge":
        return pct(rec.get(key))
    if key == "bulk":
        if "ks_distance" not in rec:
            return "—"
        from dghard_cli.report.build import has_bulk

        return "yes" if has_bulk(rec) else "no"
    if key == "lora_like":
        return "yes" if rec.get("reason") == "low-rank" or rec.get("low_rank") else "no"
    if key == "action":
        return rec["action"] + (f" ({rec['reason']})" if rec.get("reason") else "")
    if key in ("spikes", "rank_kept"):
        return _num(rec.get(key), "d")
    return _num(rec.get(key))


def summary_rows(doc: dict) -> list[tuple[str, str]]:
    s = doc["summary"]
    rows = [
        (
            "tensors",
            f"{s['tensors']} (" + ", ".join(f"{k} {v}" for k, v in s.get("actions", {}).items()) + ")",
        )
    ]
    rows.append(("matrices analysed", str(s.get("method_tensors", 0))))
    if s.get("energy_kept") is not None:
        rows.append(("energy kept", f"{pct(s['energy_kept'])} of ‖Δ‖²"))
    if s.get("rank_kept_median") is not None:
        rows.append(("rank kept", f"median {s['rank_kept_median']:g}, max {s['rank_kept_max']}"))
        rows.append(("rank 0 (base values)", str(s.get("rank_zero_tensors", 0))))
    if "bulk_found_tensors" in s:
        rows.append(
            ("noise bulk found", f"{s['bulk_found_tensors']} of {s.get('method_tensors', 0)} matrices")
        )
    rows.append(("low-rank (LoRA-like)", str(s.get("low_rank_tensors", 0))))
    rows.append(("unchanged (Δ = 0)", str(s.get("unchanged_tensors", 0))))
    params = doc.get("parameters") or {}
    if params:
        keys = ("shrink", "scale", "noise", "sigma", "a", "b", "min_numel")
        rows.append(("parameters", ", ".join(f"{k}={params[k]}" for k in keys if k in params)))
    tm = doc.get("timings") or {}
    if "total" in tm:
        rows.append(("time", f"{tm['total']:.1f} s"))
    mem = doc.get("peak_memory") or {}
    if "rss_bytes" in mem:
        rows.append(("peak RSS", f"{mem['rss_bytes'] / 2**20:.0f} MiB"))
    dev = doc.get("device") or {}
    if dev.get("used"):
        rows.append(("device", f"{dev['used']} ({dev.get('name', '')})"))
    return rows


def render_html(doc: dict, spectra: dict[str, np.ndarray] | None = None) -> str:
    """The page for a report document (``build_report`` schema); needs matplotlib."""
    plots.require_matplotlib("HTML reports")
    records = doc.get("tensors") or []
    inputs = doc.get("inputs") or {}
    title = f"dghard {doc.get('command', '')}: {doc.get('method', '')}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_e(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
    ]
    meta = []
    for key in ("base", "ft"):
        if isinstance(inputs.get(key), dict):
            meta.append(f"{key}: <code>{_e(inputs[key].get('source'))}</code>")
    for i, f in enumerate(inputs.get("fts") or [], 1):
        meta.append(f"ft #{i}: <code>{_e(f.get('source'))}</code>")
    tool = doc.get("tool") or {}
    meta.append(f"dghard {_e(tool.get('version', ''))}, {_e(doc.get('created', ''))}")
    parts.append(f'<p class="meta">{" · ".join(meta)}</p>')
    s = doc["summary"]
    if s.get("verdict"):
        parts.append(f'<p class="verdict" id="verdict">{_e(s["verdict"])}</p>')
    for w in s.get("warnings") or []:
        parts.append(f'<p class="warning">{_e(w)}</p>')
    parts.append('<h2>Summary</h2><table class="summary" id="summary">')
    for k, v in summary_rows(doc):
        parts.append(f"<tr><td>{_e(k)}</td><td class='name'>{_e(v)}</td></tr>")
    parts.append("</table>")
    for note in doc.get("notes") or []:
        parts.append(f'<p class="meta">note: {_e(note)}</p>')

    heat = [(k, plots.heatmap_png(records, k)) for k in plots.HEAT_KEYS]
    heat = [(k, png) for k, png in heat if png is not None]
    if heat:
        parts.append("<h2>Per layer and module</h2>")
        parts.append(
            '<p class="meta">Rank and share of ‖Δ‖² each matrix keeps after the cut. Grey: not '
            "filtered (LoRA: a low-rank update over rounding noise, kept as fine-tuned; =: unchanged).</p>"
        )
        for k, png in heat:
            parts.append(_img(png, f"heat map of {plots.HEAT_KEYS[k]}"))
    by_name = {r["name"]: r for r in records}
    if spectra:
        parts.append("<h2>Spectra</h2>")
        parts.append(
            '<p class="meta">Left: squared singular values of Δ in units of the noise level implied by '
            "the median, with the Marchenko–Pastur density that pure noise would follow; the dashed "
            "line is the threshold τ. Right: the singular values in order on log-log axes.</p>"
        )
        for name, sig in spectra.items():
            parts.append(
                _img(plots.spectrum_png(name, np.asarray(sig), by_name[name]), f"spectrum of {name}")
            )
    rows = [r for r in records if plots.analysed(r)]
    parts.append(f"<h2>Per matrix ({len(rows)})</h2>")
    parts.append('<table id="matrices"><tr><th class="name">tensor</th>')
    parts += [f"<th>{_e(label)}</th>" for _, label in TABLE_COLUMNS]
    parts.append("</tr>")
    for r in rows:
        parts.append(f"<tr><td class='name'>{_e(r['name'])}</td>")
        parts += [f"<td>{_e(_cell(r, key))}</td>" for key, _ in TABLE_COLUMNS]
        parts.append("</tr>")
    parts.append("</table>")
    others = [r for r in records if not plots.analysed(r)]
    if others:
        parts.append(
            f'<p class="meta">{len(others)} other tensors (norms, biases, small or excluded matrices) '
            "keep their fine-tuned values.</p>"
        )
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def write_html(doc: dict, path: str | Path, spectra: dict[str, np.ndarray] | None = None) -> Path:
    """Render and write the page atomically; InputError if its directory does not exist."""
    p = Path(path).expanduser()
    if not p.parent.exists():
        raise InputError(f"--html {path}: directory {p.parent} does not exist")
    text = render_html(doc, spectra)
    return write_text_atomic(p, text)
