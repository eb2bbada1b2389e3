"""The public API's names stay the functions they document, whatever was imported first."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

# a fresh interpreter: the subject is what importing a submodule before the name does
CHECK = """
import importlib, sys, types
for module in ("dghard_cli.merge", "dghard_cli.repair", "dghard_cli.sweep.run", "dghard_cli.score.scoring"):
    importlib.import_module(module)
import dghard_cli
from dghard_cli import merge, repair, score, sweep
bad = [f.__name__ for f in (merge, repair, score, sweep) if isinstance(f, types.ModuleType) or not callable(f)]
assert not bad, bad
assert dghard_cli.merge is merge and sys.modules["dghard_cli.merge"].merge is merge
assert "torch" in sys.modules  # the submodules were really imported
print("ok")
"""


def test_importing_a_submodule_does_not_replace_the_function_of_that_name():
    r = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
