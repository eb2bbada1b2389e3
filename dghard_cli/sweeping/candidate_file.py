"""The candidate file of ``dghard sweep`` (``--candidates``, or the built-in
``sweep-default.yaml``): its ``families`` list read and every entry checked (family, axis,
grid, range, fixed parameters), with one-line errors naming the file and the entry."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from dghard_cli.errors import InputError
from dghard_cli.io.yaml_file import read_yaml_file
from dghard_cli.sweeping.candidates import FamilyEntry, kinds
from dghard_cli.sweeping.families import family

MAX_CANDIDATES_BYTES = 1024 * 1024


DEFAULT_CANDIDATES = "sweep-default.yaml"


TOP_KEYS = ("families", "merges")


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
    return family(fam).parse_entry(raw, fam, index, where)


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
