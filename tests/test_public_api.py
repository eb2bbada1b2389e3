"""The public API's names are its functions, whatever part of the package is already loaded.

Importing a submodule binds it on its package under its own name, so a submodule named like a
public function would hide the function behind the lazy lookup (``from dghard_cli import repair``
gave the module once anything had imported it). No submodule is named so: ``repair``, ``merge``,
``sweep`` and ``score`` live in ``repairing``, ``merging``, ``sweeping`` and ``scoring``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import dghard_cli

REPO = Path(dghard_cli.__file__).resolve().parents[1]  # the checkout this run imports

NAMES = ("repair", "merge", "sweep", "score", "inspect", "verify", "audit_lora")


@pytest.mark.parametrize(
    "first",
    [
        "",  # nothing loaded yet
        "import dghard_cli.sweeping.run",  # loads dghard_cli.repairing, dghard_cli.merging and dghard_cli.sweeping
        "import dghard_cli.scoring.run",
        "from dghard_cli import RepairOptions, MergeOptions, SweepOptions",
    ],
)
def test_public_functions_are_functions(first):
    code = (
        f"{first}\n"
        "import dghard_cli\n"
        f"from dghard_cli import {', '.join(NAMES)}\n"
        f"names = {NAMES!r}\n"
        "got = [(n, type(getattr(dghard_cli, n)).__name__, type(globals()[n]).__name__) for n in names]\n"
        "bad = [g for g in got if g[1:] != ('function', 'function')]\n"
        "assert not bad, bad\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr


def test_no_submodule_is_named_like_a_public_name():
    """The package needs no module-class trick: no module or folder of the root shares a name
    with an exported one (``dghard_cli.repair`` was a module and a function at once)."""
    root = Path(dghard_cli.__file__).parent
    children = {p.stem for p in root.glob("*.py")} | {
        p.name for p in root.iterdir() if (p / "__init__.py").is_file()
    }
    assert not children & set(dghard_cli.__all__), children & set(dghard_cli.__all__)
    assert type(dghard_cli) is type(sys), "the package's module object is a plain module"
