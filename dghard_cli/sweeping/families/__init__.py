"""The families of ``dghard sweep`` candidates, behind one interface (:class:`~.base.Family`):
the shrinkers (``shrinkers.py``), one per merge method of the registry (``merge_methods.py``) and
the layer-wise strengths (``lines.py``). What the sweep does with an entry or a candidate goes
through :func:`family` and the functions below; nothing else in the sweep asks which family a
name is.

A candidate is spelled once, by its family, as the options of its command
(:func:`candidate_options`); the printed command (:func:`reproduce_argv`) and the written model
(:func:`write_candidate`) are both derived from those options, so they cannot disagree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dghard_cli.engine.writer import RunOptions
from dghard_cli.errors import InputError
from dghard_cli.io.checkpoint import Checkpoint
from dghard_cli.sweeping.candidates import Candidate, FamilyEntry
from dghard_cli.sweeping.families.base import Family, Objective, all_adapters
from dghard_cli.sweeping.families.lines import LINES
from dghard_cli.sweeping.families.merge_methods import MERGE_METHODS
from dghard_cli.sweeping.families.shrinkers import SHRINKERS

#: every family, asked in this order which names are theirs
FAMILIES: tuple[Family, ...] = (LINES, SHRINKERS, MERGE_METHODS)


def family(name: str) -> Family:
    """The family an entry's or a candidate's family name belongs to."""
    for f in FAMILIES:
        if f.has(name):
            return f
    raise InputError(f"internal error: no sweep family for {name!r}")


def make_candidate(entry: FamilyEntry, value: Any, *, n_fts: int, where: str = "candidate") -> Candidate:
    """The candidate of ``entry`` at ``value`` (an axis value; for ``lines`` an (α, β) pair or a
    per-group point): every parameter explicit and checked."""
    return family(entry.family).make_candidate(entry, value, n_fts, where)


def check_entry(entry: FamilyEntry, n_fts: int, where: str) -> None:
    """Every parameter of the candidates this entry may produce (grid and range ends)."""
    family(entry.family).check_entry(entry, n_fts, where)


def refine_probes(entry: FamilyEntry, points: dict) -> list:
    """The next refinement step of ``entry`` (empty when it is done)."""
    return family(entry.family).refine_probes(entry, points)


def entry_points(
    entry: FamilyEntry, n_fts: int, coarse: list[Candidate], evaluated: dict[tuple, Objective]
) -> dict:
    """The evaluated values of ``entry`` and their objectives."""
    return family(entry.family).entry_points(entry, n_fts, coarse, evaluated)


def degenerate_on_adapters(entry: FamilyEntry) -> bool:
    """A family whose cut needs the unknown-noise threshold, undefined on a LoRA update."""
    return family(entry.family).degenerate_on_adapters(entry)


def writes_adapter(cand: Candidate, fts: list[Checkpoint]) -> bool:
    """Whether ``cand`` is written as a PEFT adapter (its command without ``--merge``).

    Yes when every fine-tune is a LoRA adapter and the candidate is linear in their updates —
    WiSE-FT, task arithmetic, a layer-strength schedule alone, or a linear merge under one: the
    exact route of :mod:`dghard_cli.lora.output` writes it without approximation (B scaled, A
    kept; DoRA stays DoRA where :func:`~dghard_cli.lora.route_exact.dora_blocker` allows, the
    condition ``AdapterOutput.exact`` uses). Any other candidate of adapters (a spectral cut at a
    known σ, TIES, DARE, DG-Hard, DoRA that cannot stay DoRA) would be factored at a rank, so it is
    written as the full merged checkpoint. Full fine-tunes: never.
    """
    return all_adapters(fts) and family(cand.family).writes_adapter(cand)


def candidate_options(
    cand: Candidate, run: RunOptions, *, merge_adapters: bool = False, dtype: str | None = None
) -> Any:
    """The options of the command that writes ``cand`` (``merge_adapters``: the full merged
    checkpoint of LoRA fine-tunes, ``--merge``; ``dtype``: the output dtype, a safetensors name)."""
    return family(cand.family).options(cand, run, merge_adapters=merge_adapters, dtype=dtype)


def reproduce_argv(
    cand: Candidate,
    base: str,
    fts: list[str],
    out: str,
    device: str,
    *,
    merge_adapters: bool = False,
    dtype: str | None = None,
) -> list[str]:
    """The one ``dghard repair``/``dghard merge`` command line that writes this candidate: its
    options (:func:`candidate_options`) as the command spells them."""
    options = candidate_options(cand, RunOptions(device=device), merge_adapters=merge_adapters, dtype=dtype)
    return family(cand.family).argv(base, fts, out, options)


def write_candidate(
    cand: Candidate,
    base: str,
    fts: list[str],
    out: Path,
    *,
    device: str,
    argv: list[str],
    report_out: str | None = None,
    merge_adapters: bool = False,
    dtype: str | None = None,
) -> dict:
    """Write ``cand`` into ``out`` with the command's own library function; returns its report.

    ``report_out``: the output path its report names (the sweep's OUT, where the winner is
    moved); None: ``out``. ``dtype``: the output dtype of floating tensors (a safetensors name);
    None: the command's default.
    """
    run = RunOptions(device=device, quiet=True, argv=argv, report_out=report_out)
    options = candidate_options(cand, run, merge_adapters=merge_adapters, dtype=dtype)
    return family(cand.family).run(base, fts, out, options)
