"""The merge-method families of ``dghard sweep``: one per method of the registry that declares
a sweep axis, a ``dghard merge`` at one value of that axis (with several fine-tunes, or WiSE-FT
with one). A merge under a layer-strength schedule (a follow-up of the ``lines`` family) is a
candidate of its method too: its parameters carry ``lines``."""

from __future__ import annotations

from pathlib import Path

from dghard_cli.engine.plan import PolicyOptions
from dghard_cli.engine.writer import RunOptions
from dghard_cli.errors import InputError
from dghard_cli.lora.output import LoraOutputOptions, linear_coefficients
from dghard_cli.merging import MergeOptions, merge, merge_argv, resolve_parameters
from dghard_cli.methods import registry
from dghard_cli.methods.declare import LINES
from dghard_cli.sweeping.candidates import Candidate, FamilyEntry, is_number
from dghard_cli.sweeping.families.base import OneAxisFamily


class MergeMethods(OneAxisFamily):
    """Every registered merge method at one value of its sweep axis."""

    def has(self, name: str) -> bool:
        return name in registry.methods()

    def _candidate(self, entry: FamilyEntry, value: float, n_fts: int) -> Candidate:
        axis = entry.axis or entry.kind.axes[0]
        vals = {**entry.fixed, axis: value}
        weights = vals.get("weights")
        if weights is not None and (not isinstance(weights, list) or not all(is_number(w) for w in weights)):
            raise InputError("'weights' must be a list of numbers")
        given = {q.name: vals.get(q.name) for q in registry.carried_params()}
        given["weights"] = None if weights is None else [float(w) for w in weights]
        kwargs, extra = registry.options_values(given)
        p = resolve_parameters(MergeOptions(method=entry.family, extra=extra, **kwargs), n_fts)
        carried = {"method", *(q.name for q in registry.carried_params())}
        p = {k: v for k, v in p.items() if k in carried}
        params = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in p.items()))
        return Candidate(
            entry=entry.index, family=entry.family, command="merge", axis=axis, value=value, params=params
        )

    def degenerate_on_adapters(self, entry: FamilyEntry) -> bool:
        return entry.family == "dg-hard"  # DG-Hard of each update: the unknown-noise cut

    def writes_adapter(self, cand: Candidate) -> bool:
        p = cand.param_dict
        if "calibrate" in p:  # SVC re-weights the merged update's singular values: not linear
            return False
        return linear_coefficients(str(p["method"]), p) is not None

    def options(
        self, cand: Candidate, run: RunOptions, *, merge_adapters: bool, dtype: str | None
    ) -> MergeOptions:
        p = cand.param_dict
        kwargs, extra = registry.options_values({q.name: p.get(q.name) for q in registry.carried_params()})
        if "lines" in p:  # the schedule as --lines builds it
            kwargs[LINES.attr] = LINES.build([float(p["lines"][0]), float(p["lines"][1])])
        lora = LoraOutputOptions(merge=merge_adapters)
        policy = PolicyOptions(out_dtype=dtype)
        return MergeOptions(method=p["method"], extra=extra, policy=policy, run=run, lora=lora, **kwargs)

    def argv(self, base: str, fts: list[str], out: str, options: MergeOptions) -> list[str]:
        return merge_argv(base, fts, out, options)

    def run(self, base: str, fts: list[str], out: str | Path, options: MergeOptions) -> dict:
        return merge(base, fts, out, options)


MERGE_METHODS = MergeMethods()
