"""The one output-path rule: no output may land on an input or on another output of the run.

Every path a command writes (OUT, ``--report``, ``inspect --html``/``--plot``, ``score``'s
report, a recipe's report) is resolved (every symlink followed, ``..`` collapsed) and refused,
before anything is written, when it

- is an input file, or lies inside an input directory (a shard, a config, a results file: the
  tool would overwrite what it reads), or is a directory replaced as a whole (OUT) that
  contains an input;
- is the same path as another output of the same run, or a file inside an output directory
  that the command itself writes there (``--report OUT/README.md`` would be overwritten by the
  model card, ``--report OUT/model.safetensors`` would replace a shard).

The names the tool writes into OUT are reserved: an input whose index names a shard
``README.md``, ``dghard_report.json`` or the journal's name would collide with them, and is
refused (exit 2) before any work.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dghard_cli.errors import InputError
from dghard_cli.io.files import is_within, realpath

#: Files dghard itself writes into OUT (repair, merge, sweep), besides the shards.
RESERVED_NAMES = frozenset(
    {
        "README.md",
        "dghard_report.json",
        "dghard_journal.jsonl",
        "dghard_journal.jsonl.tmp",
        "model.safetensors.index.json",
        "sweep_report.json",
        "sweep_frontier.png",
    }
)


def is_reserved(name: str) -> bool:
    """A name dghard writes into OUT (or any ``*.safetensors.index.json``)."""
    return name in RESERVED_NAMES or name.endswith(".safetensors.index.json")


def check_shard_names(names: Iterable[str], where: str) -> None:
    """Refuse output shard names that collide with the files dghard writes next to them."""
    for name in names:
        if is_reserved(name):
            raise InputError(
                f"{where}: shard {name!r} has the name of a file dghard writes into OUT (its model "
                "card, report, journal or index); rename the shard file and its index entries"
            )


@dataclass(frozen=True)
class Output:
    """One output of a run: a file or a directory, and the names the run writes inside it."""

    label: str  # e.g. "--report", "OUT", "--html"
    path: Path
    is_dir: bool = False
    #: for a directory: names (relative paths) the run writes there; another output may not use them
    writes: frozenset[str] = field(default_factory=frozenset)
    #: for a directory: prefixes/suffixes of names it writes, as (prefix, suffix) pairs
    patterns: tuple[tuple[str, str], ...] = ()
    #: the directory is replaced as a whole (OUT): it may not even contain an input
    replaces: bool = False

    def claims(self, rel: str) -> bool:
        return rel in self.writes or any(rel.startswith(p) and rel.endswith(s) for p, s in self.patterns)


def resolve(path: str | Path) -> Path:
    """The path an output will really be written to (``~`` expanded, symlinks resolved)."""
    return realpath(Path(path).expanduser())


def check_outputs(inputs: Sequence[tuple[str, str | Path | None]], outputs: Sequence[Output]) -> None:
    """Apply the rule of this module; InputError (exit 2) naming both paths otherwise.

    ``inputs``: ``(label, path)`` of every input file or directory of the run (None skipped).
    """
    ins = [(label, Path(p), resolve(p)) for label, p in inputs if p is not None]
    outs = [(o, resolve(o.path)) for o in outputs]
    for o, real in outs:
        for label, given, r in ins:
            if real == r:
                raise InputError(
                    f"{o.label} {o.path} is {label} {given}; an output may never overwrite an input"
                )
            if os.path.isdir(r) and is_within(real, r):
                raise InputError(
                    f"{o.label} {o.path} lies inside {label} {given}; write outputs outside the inputs"
                )
            if is_within(r, real) and (o.replaces or (not o.is_dir and os.path.isdir(real))):
                raise InputError(
                    f"{o.label} {o.path} contains {label} {given}; write outputs outside the inputs"
                )
    for i, (a, ra) in enumerate(outs):
        for b, rb in outs[i + 1 :]:
            if ra == rb:
                raise InputError(
                    f"{a.label} {a.path} and {b.label} {b.path} are the same path; give each its own"
                )
            for d, rd, f, rf in ((a, ra, b, rb), (b, rb, a, ra)):
                if d.is_dir and is_within(rf, rd):
                    rel = os.path.relpath(rf, rd)
                    if d.claims(rel):
                        raise InputError(
                            f"{f.label} {f.path} is {rel!r} inside {d.label} {d.path}, which this command "
                            f"writes itself; choose another name for {f.label}"
                        )
