"""The public API's names are its functions, whatever part of the package is already loaded.

``repair``, ``merge``, ``sweep`` and ``score`` share their names with a submodule; importing the
submodule binds it on the package, which used to hide the function behind the lazy lookup
(``from dghard_cli import repair`` gave the module once anything had imported it).
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
        "import dghard_cli.sweep.run",  # loads dghard_cli.repair, dghard_cli.merge and dghard_cli.sweep
        "import dghard_cli.score.scoring",
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
