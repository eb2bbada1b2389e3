"""The candidate file of ``dghard sweep`` (``--candidates``, or the built-in
``sweep-default.yaml``): its ``families`` list read and every entry checked (family, axis,
grid, range, fixed parameters), with one-line errors naming the file and the entry."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from dghard_cli.errors import InputError
from dghard_cli.io.yaml_file import read_yaml_file
from dghard_cli.methods import registry
from dghard_cli.sweeping.candidates import DEFAULT_TOLERANCE, FamilyEntry, kinds
from dghard_cli.sweeping.candidates import is_number as _num
from dghard_cli.sweeping.family_dispatch import make_candidate

MAX_CANDIDATES_BYTES = 1024 * 1024


DEFAULT_CANDIDATES = "sweep-default.yaml"


TOP_KEYS = ("families", "merges")


ENTRY_KEYS = ("family", "axis", "grid", "range", "log", "tolerance", "refine", "fixed", "fine_tunes")


def parse_entry(raw: object, index: int, where: str) -> FamilyEntry:
    """Validate one entry of ``families``; InputError naming the file and entry otherwise."""
    at = f"{where}: families[{index}]"
    if not isinstance(raw, dict):
        raise InputError(f"{at}: expected a mapping with 'family' and 'grid', got {type(raw).__name__}")
    fam = raw.get("family")
    known = kinds()
    if not isinstance(fam, str) or fam.strip().lower() not in known and fam.strip().lower() != "dare":
        raise InputError(f"{at}: 'family' must be one of {', '.join(known)}, got {fam!r}")
    fam = fam.strip().lower()
    fam = "dare-linear" if fam == "dare" else fam
    if fam == "lines":
        from dghard_cli.sweeping import lines

        return lines.parse_entry(raw, index, where)
    at = f"{at} ({fam})"
    for key in raw:
        if key not in ENTRY_KEYS:
            raise InputError(f"{at}: unknown key {key!r} (known keys: {', '.join(ENTRY_KEYS)})")
    kind = known[fam]
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
        val = fixed[key]
        vkind = (
            "noise" if key == "noise" else registry.params()[key].kind if key in registry.params() else None
        )
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
            want = {
                "noise": "median or known",
                registry.WEIGHTS: "a list of numbers",
                registry.INT: "an integer",
            }
            raise InputError(f"{at}: fixed {key} must be {want.get(vkind, 'a number')}, got {val!r}")
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
        check_entry(entry, 1, at)  # merge entries are checked once the fine-tunes are known
    return entry


def check_entry(entry: FamilyEntry, n_fts: int, where: str) -> None:
    """Every parameter of the candidates this entry may produce (grid and range ends)."""
    if entry.family == "lines":
        from dghard_cli.sweeping import lines

        return lines.check_entry(entry, n_fts, where)  # type: ignore[arg-type]
    for v in (*entry.grid, entry.lo, entry.hi):
        make_candidate(entry, v, n_fts=n_fts, where=where)


def parse_candidates(doc: object, where: str) -> list[FamilyEntry]:
    """The entries of a candidate file: its ``families``, then one entry per swept merge method
    when it has a ``merges:`` block (:mod:`dghard_cli.sweeping.merges`)."""
    if not isinstance(doc, dict) or not ("families" in doc or "merges" in doc):
        raise InputError(f"{where}: expected a mapping with a 'families' list (and/or a 'merges' block)")
    unknown = [k for k in doc if k not in TOP_KEYS]
    if unknown:
        raise InputError(f"{where}: unknown top-level key {unknown[0]!r} (known: {', '.join(TOP_KEYS)})")
    fams = doc.get("families", [])
    if not isinstance(fams, list) or ("families" in doc and not fams):
        raise InputError(f"{where}: 'families' must be a non-empty list")
    entries = [parse_entry(raw, i, where) for i, raw in enumerate(fams)]
    if "merges" in doc:
        from dghard_cli.sweeping import merges

        entries += merges.block_entries(merges.parse_block(doc["merges"], where), len(entries))
    return entries


def load_candidates(path: str | Path | None) -> tuple[list[FamilyEntry], str]:
    """The entries of a candidate file (None: the built-in default set) and its name."""
    import yaml

    if path is None:
        text = resources.files("dghard_cli").joinpath("data", DEFAULT_CANDIDATES).read_text(encoding="utf-8")
        where = f"built-in {DEFAULT_CANDIDATES}"
        doc = yaml.safe_load(text)
    else:
        where = f"--candidates {path}"
        doc = read_yaml_file(Path(path).expanduser(), where, MAX_CANDIDATES_BYTES)
    return parse_candidates(doc, where), where
