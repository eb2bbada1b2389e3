"""Every import the README's real-model command reaches is installed by ``pip install -e
'.[real-model]'``, and what CI installs is the lock.

``pip install -e '.[real-model]' && python scripts/real_model_check.py`` died after two
minutes with ``ModuleNotFoundError: scipy`` (``check_repair`` imports ``tests/reference.py``).
Read statically (``ast``; nothing is installed or imported): the script's imports, followed
into the repository's own modules it imports (``scripts/``, ``tests/``: every import, those
inside functions too, since the script calls them), and into the package's modules at module
level (what importing ``dghard_cli`` and its commands needs; imports inside its functions are
optional features with extras of their own). Each third-party module must belong to a
distribution that the core dependencies or the ``real-model`` extra name.
"""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11 (CI's)


def _dist(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]).lower()


def declared(extra: str) -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {_dist(r) for r in project["dependencies"] + project["optional-dependencies"][extra]}


def _imports(tree: ast.Module, *, module_level_only: bool) -> list[str]:
    """Absolute dotted names imported in ``tree`` (relative imports are the package's own)."""
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    names = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def reached_modules(script: Path) -> set[str]:
    """Top-level names of the third-party modules that ``script`` can import, as described above."""
    local = {p.stem: p for folder in ("scripts", "tests") for p in (REPO / folder).glob("*.py")}
    package = {
        ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
        for p in (REPO / "dghard_cli").rglob("*.py")
    }
    # the script runs `python -m dghard_cli COMMAND`: the entry module and every command's module
    todo = [(script, False)] + [
        (p, True) for m, p in package.items() if m == "dghard_cli.__main__" or m.startswith("dghard_cli.cli")
    ]
    seen: set[Path] = set()
    third: set[str] = set()
    while todo:
        path, module_level = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _imports(ast.parse(path.read_text()), module_level_only=module_level):
            top = name.split(".")[0]
            if top == "dghard_cli":
                parts = name.split(".")
                prefixes = (".".join(parts[:i]) for i in range(1, len(parts) + 1))
                todo += [(package[m], True) for m in prefixes if m in package]
            elif top in local:
                todo.append((local[top], False))
            elif top not in sys.stdlib_module_names and top != "__future__":
                third.add(top)
    return third


def uncovered(script: Path, covered: set[str]) -> dict[str, list[str]]:
    """Third-party modules ``script`` reaches whose distribution ``covered`` does not name."""
    owners = packages_distributions()
    missing = {}
    for module in sorted(reached_modules(script)):
        dists = {_dist(d) for d in owners.get(module, [module])}
        if not dists & covered:
            missing[module] = sorted(dists)
    return missing


CHECK = REPO / "scripts" / "real_model_check.py"


def test_the_real_model_check_needs_nothing_beyond_the_real_model_extra():
    assert {"numpy", "scipy", "torch", "transformers", "gguf", "safetensors", "typer"} <= reached_modules(
        CHECK
    )
    missing = uncovered(CHECK, declared("real-model"))
    assert not missing, (
        f"imported by the real-model check but in neither the core nor [real-model]: {missing}"
    )


def test_the_walk_finds_an_import_hidden_in_a_helpers_function():
    """How scipy was missed: ``check_repair`` imports ``tests/reference.py`` inside a function,
    and reference.py imports scipy. Without scipy in the extra, the walk names it."""
    assert uncovered(CHECK, declared("real-model") - {"scipy"}) == {"scipy": ["scipy"]}


def test_ci_installs_through_the_lock():
    """.ci/run installs every package with ``-c constraints.txt`` (build dependencies too) and
    checks the result; the README's test command installs through the same file."""
    ci = (REPO / ".ci" / "run").read_text().replace("\\\n", " ")  # continued lines joined
    installs = [
        ln for ln in ci.splitlines() if re.search(r"pip install", ln) and not ln.lstrip().startswith("#")
    ]
    assert installs
    for line in installs:
        assert '-c "$LOCK"' in line or "--index-url https://download.pytorch.org/whl/cpu" in line, line
    assert "LOCK=constraints.txt" in ci and '--build-constraint "$LOCK"' in ci
    assert "python scripts/constraints.py check" in ci
    readme = (REPO / "README.md").read_text()
    assert "pip install -e '.[test]' -c constraints.txt && python -m pytest -q" in readme


def test_the_lock_pins_every_package_exactly():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import constraints
    finally:
        sys.path.remove(str(REPO / "scripts"))
    pins = constraints.read_pins((REPO / "constraints.txt").read_text())
    for name in ("torch", "peft", "transformers", "lm-eval", "ray", "ruff", "pytest", "pip", "setuptools"):
        assert name in pins, name
    assert pins["torch"] == "2.13.0"
    assert constraints.compare({"peft": "0.23.0", "x": "1"}, {"peft": "0.22.0"}) == [
        "peft==0.23.0 is installed; constraints.txt pins 0.22.0",
        "x==1 is installed but not pinned",
    ]
    # the CUDA build's runtime wheels (.ci/run's fallback) are the torch build's, not the lock's
    assert constraints.compare({"nvidia-cublas-cu12": "12.9", "triton": "3.6"}, {}) == []
    with pytest.raises(ValueError, match="not a plain name==version pin"):
        constraints.read_pins("peft>=0.22\n")
