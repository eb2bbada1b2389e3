"""The sweep's frontier plot: % repair against % retention for every scored candidate, one
colour per family, the Pareto front joined, the winner starred, BASE and FT as references
(PNG bytes; matplotlib is the optional ``dghard[plot]`` extra, drawn headless like
:mod:`dghard_cli.report.plots`)."""

from __future__ import annotations

from dghard_cli.report.plots import _png

FAMILY_COLOURS = (
    "#4a78a8",
    "#c0392b",
    "#2e8b57",
    "#8e44ad",
    "#d68910",
    "#17a2b8",
    "#7f8c8d",
    "#b03a2e",
    "#1abc9c",
    "#34495e",
)


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points no other point beats on both axes, sorted by the first coordinate."""
    front = [p for p in points if not any(q[0] >= p[0] and q[1] >= p[1] and q != p for q in points)]
    return sorted(set(front))


def frontier_png(
    rows: list[dict], winner: dict | None, refs: dict[str, dict], *, several: bool = False
) -> bytes | None:
    """The plot, or None when no candidate has both % repair and % retention defined.

    ``several``: several fine-tunes (the axes are scored against each benchmark's expert, and
    every fine-tune is drawn as a reference).

    Raises ImportError when matplotlib is not installed.
    """
    from matplotlib.figure import Figure

    pts = [r for r in rows if r.get("repair") is not None and r.get("retention") is not None]
    if not pts:
        return None
    fig = Figure(figsize=(7.5, 5.6))
    ax = fig.subplots()
    families = list(dict.fromkeys(r["family"] for r in pts))
    for i, fam in enumerate(families):
        colour = FAMILY_COLOURS[i % len(FAMILY_COLOURS)]
        feas = [r for r in pts if r["family"] == fam and r.get("feasible")]
        infeas = [r for r in pts if r["family"] == fam and not r.get("feasible")]
        if feas:
            ax.plot(
                [r["retention"] for r in feas],
                [r["repair"] for r in feas],
                "o",
                ms=6,
                color=colour,
                label=fam,
            )
        if infeas:
            ax.plot(
                [r["retention"] for r in infeas],
                [r["repair"] for r in infeas],
                "o",
                ms=6,
                mfc="none",
                color=colour,
                label=f"{fam} (target below the bar)" if not feas else None,
            )
    front = pareto([(r["retention"], r["repair"]) for r in pts if r.get("feasible")])
    if len(front) > 1:
        ax.plot(
            [p[0] for p in front],
            [p[1] for p in front],
            "-",
            lw=1,
            color="#888888",
            zorder=0,
            label="frontier",
        )
    names = [("BASE", "s"), *((n, "D") for n in refs if n.startswith("FT"))]
    for i, (name, marker) in enumerate(names):
        sc = refs.get(name)
        if sc and sc.get("repair") is not None and sc.get("retention") is not None:
            ax.plot(sc["retention"], sc["repair"], marker, ms=7, color="black", mfc="white")
            lift = 4 + 9 * max(0, i - 1)  # several fine-tunes often land together: stack their names
            ax.annotate(
                name,
                (sc["retention"], sc["repair"]),
                textcoords="offset points",
                xytext=(6, lift),
                fontsize=8,
            )
    if winner is not None and winner.get("repair") is not None and winner.get("retention") is not None:
        ax.plot(
            winner["retention"],
            winner["repair"],
            "*",
            ms=18,
            color="#f1c40f",
            mec="black",
            zorder=5,
            label="winner",
        )
        ax.annotate(
            f"{winner['name']}\nHM {winner['hm']:.1f}",
            (winner["retention"], winner["repair"]),
            textcoords="offset points",
            xytext=(10, -18),
            fontsize=8,
            bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "#999999", "alpha": 0.9},
        )
    if several:
        ax.set_xlabel("% retention (of each expert's gain: targets and improved benchmarks)")
        ax.set_ylabel("% repair (of the worst fine-tune's damage to the base's skills)")
    else:
        ax.set_xlabel("% retention (of the fine-tune's gains on improved benchmarks)")
        ax.set_ylabel("% repair (of the damage on damaged benchmarks)")
    ax.axhline(0, color="#cccccc", lw=0.8, zorder=0)
    ax.axvline(0, color="#cccccc", lw=0.8, zorder=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best", framealpha=0.9)
    ax.set_title("dghard sweep: repair vs retention per candidate", fontsize=10)
    fig.tight_layout()
    return _png(fig)
