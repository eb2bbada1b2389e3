"""Pictures of spectral reports: per-matrix spectra and layers x modules heat maps (PNG bytes).

matplotlib is an optional extra (``pip install 'dghard[plot]'``). Figures are drawn with the
object-oriented API on an Agg canvas, so nothing here needs a display or touches pyplot's
global state. The numbers come from the records that :mod:`dghard_cli.report.build` summarises
(and, for a spectrum, the matrix's singular values); nothing is recomputed here except the
Marchenko–Pastur density drawn over the histogram.
"""

from __future__ import annotations

import io
import math
import re

import numpy as np

from dghard_cli.architecture import layer_module
from dghard_cli.errors import InputError
from dghard_cli.spectral.marchenko_pastur import mp_support
from dghard_cli.spectral.shrinkers import noise_from_median

EXTRA_HINT = "pip install 'dghard[plot]'"


def require_matplotlib(what: str = "plots") -> None:
    """Raise InputError (exit 2) naming the extra when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
        from matplotlib.figure import Figure  # noqa: F401
    except ImportError:
        raise InputError(f"{what} need matplotlib, which is not installed: {EXTRA_HINT}") from None


#: Layer index and module name of a per-layer tensor (see :mod:`dghard_cli.architecture`).
parse_layer_module = layer_module


def mp_density(x: np.ndarray, beta: float) -> np.ndarray:
    """Marchenko–Pastur density (ratio ``beta``, unit variance); 0 outside the support."""
    a, b = mp_support(beta)
    x = np.asarray(x, dtype=np.float64)
    inside = (x > a) & (x < b) & (x > 0)
    out = np.zeros_like(x)
    xi = x[inside]
    out[inside] = np.sqrt((b - xi) * (xi - a)) / (2.0 * math.pi * beta * xi)
    return out


def _png(fig) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def analysed(rec: dict) -> bool:
    """A record whose matrix had its spectrum computed (method, resized, low-rank, unchanged)."""
    return "rank_kept" in rec or rec.get("reason") in ("low-rank", "unchanged")


def spectrum_png(name: str, sigma: np.ndarray, rec: dict) -> bytes:
    """Two panels: the histogram of σ²/(N·ŝ²) with the fitted MP density, the τ line and the
    bulk edge; and σ_i against i on log-log axes (kept components in red)."""
    from matplotlib.figure import Figure

    sigma = np.sort(np.asarray(sigma, dtype=np.float64))[::-1]
    m, n = rec["shape"][0], rec["shape"][1]
    if rec.get("shared_rows"):
        m = rec["shared_rows"]
    big, small = max(m, n), min(m, n)
    beta = small / big
    tau = float(rec.get("tau") or 0.0)
    noise = noise_from_median(float(np.median(sigma)), (m, n)) if sigma.size else 0.0
    fig = Figure(figsize=(11, 4.2))
    ax1, ax2 = fig.subplots(1, 2)

    if noise > 0:
        x = sigma**2 / (big * noise**2)
        a, b = mp_support(beta)
        xt = tau**2 / (big * noise**2)
        hi = max(b, xt) * 1.3
        inside = x[x <= hi]
        bins = int(min(80, max(10, small // 4)))
        counts, edges = np.histogram(inside, bins=bins, range=(0.0, hi))
        width = edges[1] - edges[0]
        ax1.bar(
            edges[:-1],
            counts / (small * width),
            width=width,
            align="edge",
            color="#8fb3d9",
            edgecolor="#4a78a8",
            linewidth=0.4,
            label="σ² / (N ŝ²)",
        )
        grid = np.linspace(max(a, 1e-9), b, 400)
        ax1.plot(grid, mp_density(grid, beta), color="black", lw=1.4, label=f"Marchenko–Pastur β={beta:.3g}")
        ax1.axvline(xt, color="#c0392b", ls="--", lw=1.4, label="τ (threshold)")
        ax1.axvline(b, color="grey", ls=":", lw=1.2, label="MP bulk edge")
        beyond = int(np.count_nonzero(x > hi))
        if beyond:
            ax1.annotate(
                f"{beyond} value{'s' if beyond > 1 else ''} beyond the axis → (max {x.max():.3g})",
                xy=(0.98, 0.96),
                xycoords="axes fraction",
                ha="right",
                va="top",
                fontsize=8,
                color="#c0392b",
                bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.9},
            )
        ax1.set_xlim(0, hi)
        ax1.set_xlabel(f"σ² / (N ŝ²),  ŝ = {noise:.3g} (from the median)")
        ax1.set_ylabel("density")
        ax1.legend(fontsize=7, loc="center right", framealpha=0.9)
    else:
        ax1.text(0.5, 0.5, "median singular value is 0:\nno noise level to fit", ha="center", va="center")
        ax1.set_axis_off()
    ax1.set_title("spectrum vs fitted noise bulk", fontsize=10)

    idx = np.arange(1, sigma.size + 1)
    pos = sigma > 0
    kept = (sigma > tau) & pos
    ax2.loglog(idx[pos & ~kept], sigma[pos & ~kept], ".", ms=3, color="#4a78a8", label="dropped")
    if kept.any():
        ax2.loglog(idx[kept], sigma[kept], "o", ms=4, color="#c0392b", label=f"kept ({int(kept.sum())})")
    if tau > 0:
        ax2.axhline(tau, color="#c0392b", ls="--", lw=1.2, label=f"τ = {tau:.3g}")
    edge = rec.get("mp_edge")
    if edge:
        ax2.axhline(edge, color="grey", ls=":", lw=1.2, label="MP bulk edge")
    ax2.set_xlabel("index i")
    ax2.set_ylabel("singular value σ_i")
    ax2.set_title("singular values (log-log)", fontsize=10)
    ax2.legend(fontsize=7)
    e = rec.get("energy_kept")
    ks = rec.get("ks_distance")
    fig.suptitle(
        f"{name}  [{m}×{n}]  rank kept {rec.get('rank_kept', '—')}, energy kept "
        f"{'—' if e is None else f'{100 * e:.1f} %'}, KS {'—' if ks is None else f'{ks:.3f}'}"
        + ("  (LoRA-like)" if rec.get("reason") == "low-rank" else ""),
        fontsize=10,
    )
    fig.tight_layout()
    return _png(fig)


HEAT_KEYS = {
    "rank_kept": "rank kept",
    "energy_kept": "energy kept (% of ‖Δ‖²)",
}


_ATTENTION = ("attn", "attention")
_MLP = ("mlp", "feed_forward", "ffn")
_PROJ_ORDER = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def module_order(module: str) -> tuple[int, int, str]:
    """Attention before MLP; q, k, v, o, gate, up, down; the rest by name."""
    low = module.lower()
    group = 0 if any(w in low for w in _ATTENTION) else 1 if any(w in low for w in _MLP) else 2
    last = low.rsplit(".", 1)[-1]
    rank = _PROJ_ORDER.index(last) if last in _PROJ_ORDER else len(_PROJ_ORDER)
    return group, rank, module


def heatmap_grid(records: list[dict], key: str) -> tuple[list[int], list[str], np.ndarray, list[list[str]]]:
    """Layers, modules, the value grid (NaN where nothing to show) and the cell labels."""
    cells: dict[tuple[int, str], dict] = {}
    layers: list[int] = []
    modules: list[str] = []
    for r in records:
        if not analysed(r):
            continue
        lm = parse_layer_module(r["name"])
        if lm is None:
            continue
        cells[lm] = r
        if lm[0] not in layers:
            layers.append(lm[0])
        if lm[1] not in modules:
            modules.append(lm[1])
    layers.sort()
    modules.sort(key=module_order)
    grid = np.full((len(layers), len(modules)), np.nan)
    labels = [["" for _ in modules] for _ in layers]
    for (layer, mod), r in cells.items():
        i, j = layers.index(layer), modules.index(mod)
        if r.get("reason") == "low-rank":
            labels[i][j] = "LoRA"
        elif r.get("reason") == "unchanged":
            labels[i][j] = "="
        elif r.get(key) is not None:
            v = float(r[key]) * (100.0 if key == "energy_kept" else 1.0)
            grid[i, j] = v
            labels[i][j] = f"{v:.0f}"
    return layers, modules, grid, labels


def heatmap_png(records: list[dict], key: str) -> bytes | None:
    """Layers (rows) x modules (columns) heat map of ``rank_kept`` or ``energy_kept``;
    None when no tensor name carries a layer index."""
    from matplotlib.figure import Figure

    layers, modules, grid, labels = heatmap_grid(records, key)
    if not layers:
        return None
    h = min(40.0, 1.6 + 0.3 * len(layers))
    w = min(24.0, 3.2 + 1.0 * len(modules))
    fig = Figure(figsize=(w, h))
    ax = fig.subplots()
    import matplotlib

    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#d0d0d0")
    masked = np.ma.masked_invalid(grid)
    vmin = 0.0
    vmax = (
        100.0
        if key == "energy_kept"
        else max(1.0, float(np.nanmax(grid)) if np.isfinite(grid).any() else 1.0)
    )
    im = ax.imshow(masked, aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
    ax.set_xticks(range(len(modules)))
    ax.set_xticklabels(modules, rotation=35, ha="right", fontsize=8)
    ax.set_yticks(range(len(layers)))
    ax.set_yticklabels([str(x) for x in layers], fontsize=7 if len(layers) > 30 else 8)
    ax.set_ylabel("layer")
    if len(layers) * len(modules) <= 600:
        for i in range(len(layers)):
            for j in range(len(modules)):
                if not labels[i][j]:
                    continue
                v = grid[i, j]
                light = math.isnan(v) or (v - vmin) / (vmax - vmin or 1.0) > 0.6
                ax.text(
                    j,
                    i,
                    labels[i][j],
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="black" if light else "white",
                )
    fig.colorbar(im, ax=ax, fraction=0.05, pad=0.02)
    ax.set_title(f"{HEAT_KEYS[key]} per matrix (grey: not filtered)", fontsize=10)
    fig.tight_layout()
    return _png(fig)


def safe_filename(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "tensor"
