"""Command-line options and output of LoRA runs (``--format``, ``--merge``, ``--rank``)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.text import Text

from dghard_cli.engine.adapter_run import LoraOutputOptions

FormatOpt = Annotated[
    str,
    typer.Option(
        "--format",
        help="Output: auto (an adapter when every FT is a PEFT LoRA adapter, else a full checkpoint), "
        "full, or peft (a PEFT LoRA adapter whose per-module rank is the kept rank).",
    ),
]
MergeOpt = Annotated[
    bool,
    typer.Option(
        "--merge",
        help="FT is a LoRA adapter: write the full merged checkpoint (BASE + ΔW, as PEFT's merge_and_unload) "
        "instead of an adapter.",
    ),
]
RankOpt = Annotated[
    Optional[int],
    typer.Option(
        "--rank",
        help="--format peft: truncate each module's update to this rank with the exact SVD (needed when "
        "the update is not low-rank: TIES, DARE, strengths of full fine-tunes); the energy lost is reported.",
    ),
]


def lora_options(fmt: str, merge: bool, rank: int | None) -> LoraOutputOptions:
    return LoraOutputOptions(format=fmt.strip().lower(), merge=merge, rank=rank)


def is_adapter_doc(doc: dict) -> bool:
    return (doc.get("output") or {}).get("format") == "peft"


def render_adapter(console: Console, doc: dict) -> None:
    """The summary of an adapter output."""
    from rich.table import Table

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
