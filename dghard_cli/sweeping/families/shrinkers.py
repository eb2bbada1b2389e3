"""The shrinker families of ``dghard sweep`` (``hard``, ``soft``, ``optimal``, ``twoknob``): a
``dghard repair`` at one strength of its axis (the threshold's scale, or twoknob's a or b)."""

from __future__ import annotations

from pathlib import Path

from dghard_cli.engine.plan import PolicyOptions
from dghard_cli.engine.writer import RunOptions
from dghard_cli.lora.output import LoraOutputOptions
from dghard_cli.repairing import RepairOptions, repair, repair_argv
from dghard_cli.spectral.spectrum import ShrinkSpec
from dghard_cli.sweeping.candidates import Candidate, FamilyEntry, kinds
from dghard_cli.sweeping.families.base import OneAxisFamily


def shrink_spec(p: dict) -> ShrinkSpec:
    """The filter a candidate's parameters name (``shrink``, ``scale``, ``noise``, ...)."""
    return ShrinkSpec(
        shrink=p["shrink"],
        scale=p["scale"],
        noise=p["noise"],
        sigma=p.get("sigma"),
        a=p.get("a", 1.0),
        b=p.get("b", 0.0),
    )


def spec_params(spec: ShrinkSpec) -> dict:
    """A filter's parameters as a candidate carries them (the twoknob and known-noise ones only
    where they apply)."""
    p = {"shrink": spec.shrink, "scale": spec.scale, "noise": spec.noise}
    if spec.noise == "known":
        p["sigma"] = spec.sigma
    if spec.shrink == "twoknob":
        p["a"], p["b"] = spec.a, spec.b
    return p


def repair_options(run: RunOptions, merge_adapters: bool, dtype: str | None, **what) -> RepairOptions:
    """``RepairOptions`` of a candidate: ``what`` (the filter, the schedule) and the output."""
    lora = LoraOutputOptions(merge=merge_adapters)
    return RepairOptions(policy=PolicyOptions(out_dtype=dtype), run=run, lora=lora, **what)


class RepairCommand:
    """A family whose candidates are ``dghard repair`` runs (one fine-tune)."""

    def argv(self, base: str, fts: list[str], out: str, options: RepairOptions) -> list[str]:
        return repair_argv(base, fts[0], out, options)

    def run(self, base: str, fts: list[str], out: str | Path, options: RepairOptions) -> dict:
        return repair(base, fts[0], out, options)


class Shrinkers(RepairCommand, OneAxisFamily):
    """DG-Hard and the other shrinkers at one value of their axis."""

    def has(self, name: str) -> bool:
        kind = kinds().get(name)
        return kind is not None and kind.command == "repair" and name != "lines"

    def _candidate(self, entry: FamilyEntry, value: float, n_fts: int) -> Candidate:
        axis = entry.axis or entry.kind.axes[0]
        vals = {**entry.fixed, axis: value}
        spec = ShrinkSpec(
            shrink=entry.family,
            scale=float(vals.get("scale", 1.0)),
            noise=str(vals.get("noise", "known" if "sigma" in vals else "median")),
            sigma=None if vals.get("sigma") is None else float(vals["sigma"]),
            a=float(vals.get("a", 1.0)),
            b=float(vals.get("b", 0.0)),
        )
        params = tuple(sorted(spec_params(spec).items()))
        return Candidate(
            entry=entry.index, family=entry.family, command="repair", axis=axis, value=value, params=params
        )

    def degenerate_on_adapters(self, entry: FamilyEntry) -> bool:
        return "sigma" not in entry.fixed and entry.fixed.get("noise") != "known"

    def writes_adapter(self, cand: Candidate) -> bool:
        return False  # a cut at a known σ is factored at a rank: the merged checkpoint instead

    def options(
        self, cand: Candidate, run: RunOptions, *, merge_adapters: bool, dtype: str | None
    ) -> RepairOptions:
        return repair_options(run, merge_adapters, dtype, spec=shrink_spec(cand.param_dict))


SHRINKERS = Shrinkers()
