"""What a family of ``dghard sweep`` candidates is (:class:`Family`), and the one-axis search
that every family but ``lines`` shares (:class:`OneAxisFamily`).

A family turns an entry of the candidate file into candidates and a candidate into the options
of its command; everything the sweep prints or writes for a candidate is derived from those
options: the command line by the command's own ``repair_argv``/``merge_argv``, the model by its
library function (``repair``/``merge``). So a candidate is spelled once, by its family.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from dghard_cli.engine.writer import RunOptions
from dghard_cli.errors import InputError
from dghard_cli.io.checkpoint import Checkpoint
from dghard_cli.lora.route_exact import dora_blocker, uses_dora
from dghard_cli.lora.source import is_adapter
from dghard_cli.methods import registry
from dghard_cli.sweeping.candidates import DEFAULT_TOLERANCE, Candidate, FamilyEntry, kinds, round_sig
from dghard_cli.sweeping.candidates import is_number as _num

#: 2 − φ: where golden-section search puts its next probe inside the wider side.
GOLDEN = (3.0 - math.sqrt(5.0)) / 2.0

#: An objective is any comparable tuple (larger is better); None for a candidate that failed.
Objective = tuple | None

#: The keys of a one-axis entry of the candidate file.
ENTRY_KEYS = ("family", "axis", "grid", "range", "log", "tolerance", "refine", "fixed", "fine_tunes")


class Family(Protocol):
    """One kind of candidate: how its entries are read and searched, and what its candidates run."""

    def has(self, name: str) -> bool:
        """Whether ``name`` (an entry's or a candidate's family) is one of this family's."""
        ...

    def parse_entry(self, raw: dict, family: str, index: int, where: str) -> FamilyEntry:
        """The entry ``raw`` of the candidate file (``family``: its normalised name), checked."""
        ...

    def check_entry(self, entry: FamilyEntry, n_fts: int, where: str) -> None:
        """Every candidate the entry may produce is valid with ``n_fts`` fine-tunes."""
        ...

    def make_candidate(self, entry: FamilyEntry, value: Any, n_fts: int, where: str) -> Candidate:
        """The candidate of ``entry`` at ``value``: every parameter explicit and checked."""
        ...

    def refine_probes(self, entry: FamilyEntry, points: dict) -> list:
        """The next refinement step's values (empty: the entry is done)."""
        ...

    def entry_points(
        self, entry: FamilyEntry, n_fts: int, coarse: list[Candidate], evaluated: dict[tuple, Objective]
    ) -> dict:
        """The evaluated values of ``entry`` and their objectives."""
        ...

    def degenerate_on_adapters(self, entry: FamilyEntry) -> bool:
        """Whether the entry's cut needs the unknown-noise threshold, undefined on a LoRA update."""
        ...

    def writes_adapter(self, cand: Candidate) -> bool:
        """Whether ``cand`` of LoRA fine-tunes is exact as an adapter (else: the merged checkpoint)."""
        ...

    def options(self, cand: Candidate, run: RunOptions, *, merge_adapters: bool, dtype: str | None) -> Any:
        """The options of the command that writes ``cand`` (``RepairOptions``/``MergeOptions``)."""
        ...

    def argv(self, base: str, fts: list[str], out: str, options: Any) -> list[str]:
        """The command line that runs ``options``."""
        ...

    def run(self, base: str, fts: list[str], out: Any, options: Any) -> dict:
        """Run ``options`` with the command's library function; its report."""
        ...


class OneAxisFamily:
    """A family with one strength axis: a grid, then golden-section refinement on the axis."""

    def _candidate(self, entry: FamilyEntry, value: float, n_fts: int) -> Candidate:
        raise NotImplementedError

    def make_candidate(self, entry: FamilyEntry, value: Any, n_fts: int, where: str) -> Candidate:
        try:
            return self._candidate(entry, float(value), n_fts)
        except InputError as exc:
            raise InputError(f"{where}: {exc}") from None

    def check_entry(self, entry: FamilyEntry, n_fts: int, where: str) -> None:
        for v in (*entry.grid, entry.lo, entry.hi):
            self.make_candidate(entry, v, n_fts, where)

    def refine_probes(self, entry: FamilyEntry, points: dict[float, Objective]) -> list:
        """A golden-section step: a probe on each side of the best point that is still wide
        enough, the wider side first (see :mod:`dghard_cli.sweeping.search`)."""
        if not entry.refine:
            return []
        ok = {v: o for v, o in points.items() if o is not None}
        if not ok:
            return []
        best = max(ok, key=lambda v: (ok[v], -v))  # equal objectives: the smallest value
        xs = sorted(points)
        i = xs.index(best)
        u = entry.coord(best)
        left = entry.coord(xs[i - 1]) if i > 0 else entry.coord(entry.lo)
        right = entry.coord(xs[i + 1]) if i + 1 < len(xs) else entry.coord(entry.hi)
        wl, wr = u - left, right - u
        span = entry.coord(entry.hi) - entry.coord(entry.lo)
        sides = [(wr, 1.0), (wl, -1.0)] if wr >= wl else [(wl, -1.0), (wr, 1.0)]
        out: list[float] = []
        for width, sign in sides:
            if width < entry.tolerance * span:
                continue
            probe = round_sig(entry.value(u + sign * GOLDEN * width))
            probe = min(max(probe, entry.lo), entry.hi)
            if probe not in points and probe != best and probe not in out:
                out.append(probe)
        return out

    def entry_points(
        self, entry: FamilyEntry, n_fts: int, coarse: list[Candidate], evaluated: dict[tuple, Objective]
    ) -> dict[float, Objective]:
        # the entry's own grid and every value refinement produced are candidates of this entry;
        # they are found by regenerating the candidate of each evaluated value of the axis
        out: dict[float, Objective] = {}
        for params, obj in evaluated.items():
            d = dict(params)
            v = d.get(entry.axis)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            if self.make_candidate(entry, float(v), n_fts, "candidate").params == params:
                out[float(v)] = obj
        return out

    def parse_entry(self, raw: dict, family: str, index: int, where: str) -> FamilyEntry:
        """Validate one entry of ``families``; InputError naming the file and entry otherwise."""
        fam = family
        at = f"{where}: families[{index}] ({fam})"
        for key in raw:
            if key not in ENTRY_KEYS:
                raise InputError(f"{at}: unknown key {key!r} (known keys: {', '.join(ENTRY_KEYS)})")
        kind = kinds()[fam]
        axis = raw.get("axis", kind.axes[0])
        if axis not in kind.axes:
            raise InputError(f"{at}: axis {axis!r} cannot be swept for {fam} (axes: {', '.join(kind.axes)})")
        grid = raw.get("grid")
        if isinstance(grid, (int, float)) and not isinstance(grid, bool):
            grid = [grid]
        if not isinstance(grid, list) or not grid or not all(_num(g) for g in grid):
            raise InputError(f"{at}: 'grid' must be a non-empty list of numbers (values of {axis})")
        grid = [float(g) for g in grid]
        rng = raw.get("range", kind.ranges[axis])
        if (
            not isinstance(rng, (list, tuple))
            or len(rng) != 2
            or not all(_num(x) for x in rng)
            or not float(rng[0]) < float(rng[1])
        ):
            raise InputError(f"{at}: 'range' must be [low, high] with low < high, got {rng!r}")
        rng = (float(rng[0]), float(rng[1]))
        log = raw.get("log", axis in kind.log_axes)
        if not isinstance(log, bool):
            raise InputError(f"{at}: 'log' must be true or false")
        if log and rng[0] <= 0:
            raise InputError(f"{at}: a log axis needs range low > 0, got {rng[0]:g} (set log: false)")
        for g in grid:
            if not rng[0] <= g <= rng[1]:
                raise InputError(f"{at}: grid value {g:g} lies outside range [{rng[0]:g}, {rng[1]:g}]")
        tol = raw.get("tolerance", DEFAULT_TOLERANCE)
        if not _num(tol) or not 0 < float(tol) <= 1:
            raise InputError(f"{at}: 'tolerance' must be a number in (0, 1] (share of the range)")
        refine = raw.get("refine", True)
        if not isinstance(refine, bool):
            raise InputError(f"{at}: 'refine' must be true or false")
        fixed = raw.get("fixed", {}) or {}
        if not isinstance(fixed, dict):
            raise InputError(f"{at}: 'fixed' must be a mapping of parameter: value")
        for key in fixed:
            if key not in kind.fixed:
                allowed = ", ".join(kind.fixed) or "none"
                raise InputError(f"{at}: parameter {key!r} cannot be fixed for {fam} (allowed: {allowed})")
            if key == axis:
                raise InputError(f"{at}: {key!r} is the swept axis and cannot also be fixed")
            _check_fixed(at, key, fixed[key])
        when = raw.get("fine_tunes")
        if when is not None:
            if when not in ("one", "several", "any"):
                raise InputError(f"{at}: 'fine_tunes' must be one, several or any, got {when!r}")
            if kind.fine_tunes == "one" and when != "one":
                raise InputError(f"{at}: {fam} takes exactly one fine-tune (fine_tunes: one)")
        entry = FamilyEntry(
            family=fam,
            grid=grid,
            axis=axis,
            range=rng,
            log=log,
            tolerance=float(tol),
            refine=refine,
            fixed=dict(fixed),
            fine_tunes=when,
            index=index,
        )
        if kind.command == "repair" or kind.fine_tunes == "one":
            self.check_entry(entry, 1, at)  # merge entries are checked once the fine-tunes are known
        return entry


def _check_fixed(at: str, key: str, val: object) -> None:
    """A fixed parameter's value has its parameter's kind."""
    vkind = "noise" if key == "noise" else registry.params()[key].kind if key in registry.params() else None
    ok = (
        isinstance(val, str)
        if vkind == "noise"
        else isinstance(val, list) and bool(val) and all(_num(w) for w in val)
        if vkind == registry.WEIGHTS
        else isinstance(val, int) and not isinstance(val, bool)
        if vkind == registry.INT
        else _num(val)
    )
    if not ok:
        want = {"noise": "median or known", registry.WEIGHTS: "a list of numbers", registry.INT: "an integer"}
        raise InputError(f"{at}: fixed {key} must be {want.get(vkind, 'a number')}, got {val!r}")


def all_adapters(fts: list[Checkpoint]) -> bool:
    """Every fine-tune is a LoRA adapter whose DoRA (if any) can stay DoRA in the exact route."""
    if not fts or not all(is_adapter(f) for f in fts):
        return False
    return not (uses_dora(fts) and dora_blocker(fts) is not None)
