"""The ``lines`` family of ``dghard sweep`` (LiNeS): ``dghard repair --lines α,β`` (or the
per-group ``--layer-strengths`` of ``--refine groups``), over a shrinker when the entry fixes
one; two-dimensional, so it has its own entry, candidates and compass search
(:mod:`dghard_cli.sweeping.lines`)."""

from __future__ import annotations

from typing import Any

from dghard_cli.engine.writer import RunOptions
from dghard_cli.repairing import RepairOptions
from dghard_cli.schedule.spec import LayerSchedule, parse_layer_strengths
from dghard_cli.sweeping import lines
from dghard_cli.sweeping.candidates import Candidate, FamilyEntry
from dghard_cli.sweeping.families.base import Objective
from dghard_cli.sweeping.families.shrinkers import RepairCommand, repair_options, shrink_spec


class Lines(RepairCommand):
    """Layer-wise strengths λ(ℓ) = α + β·ℓ/(L−1), alone or over a shrinker."""

    name = "lines"

    def has(self, name: str) -> bool:
        return name == self.name

    def parse_entry(self, raw: dict, family: str, index: int, where: str) -> FamilyEntry:
        return lines.parse_entry(raw, index, where)

    def check_entry(self, entry: FamilyEntry, n_fts: int, where: str) -> None:
        lines.check_entry(entry, n_fts, where)  # type: ignore[arg-type]

    def make_candidate(self, entry: FamilyEntry, value: Any, n_fts: int, where: str) -> Candidate:
        return lines.make_candidate(entry, value, n_fts=n_fts, where=where)  # type: ignore[arg-type]

    def refine_probes(self, entry: FamilyEntry, points: dict) -> list:
        return lines.refine_probes(entry, points)  # type: ignore[arg-type]

    def entry_points(
        self, entry: FamilyEntry, n_fts: int, coarse: list[Candidate], evaluated: dict[tuple, Objective]
    ) -> dict:
        return lines.entry_points(entry, evaluated)  # type: ignore[arg-type]

    def degenerate_on_adapters(self, entry: FamilyEntry) -> bool:
        return "shrink" in entry.fixed  # the schedule alone is exact on any update; over a cut it is not

    def writes_adapter(self, cand: Candidate) -> bool:
        return "shrink" not in cand.param_dict  # a schedule alone is linear in the update

    def options(
        self, cand: Candidate, run: RunOptions, *, merge_adapters: bool, dtype: str | None
    ) -> RepairOptions:
        p = cand.param_dict
        if "lines" in p:
            schedule = LayerSchedule(alpha=float(p["lines"][0]), beta=float(p["lines"][1]))
        else:
            schedule = parse_layer_strengths(p["layer_strengths"])
        spec = shrink_spec(p) if "shrink" in p else None
        return repair_options(run, merge_adapters, dtype, spec=spec, schedule=schedule)


LINES = Lines()
