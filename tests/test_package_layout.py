"""The package's import graph has no cycles.

Read statically (``ast``, nothing is imported): a module's edges are its ``import X`` (an edge to
``X``) and ``from X import Y`` (an edge to ``X.Y`` when that is a module, else to ``X``), relative
imports resolved, imports inside functions included, imports under ``if TYPE_CHECKING:`` left
out (they never run). Any strongly connected component of more than one module is a cycle: two
modules that each need the other, so neither can be read, tested or moved alone.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import dghard_cli

PACKAGE_ROOT = Path(dghard_cli.__file__).parent


def package_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under the package at ``root``."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING``, ``typing.TYPE_CHECKING`` or an alias such as ``_TYPE_CHECKING``."""
    name = test.attr if isinstance(test, ast.Attribute) else test.id if isinstance(test, ast.Name) else ""
    return name.endswith("TYPE_CHECKING")


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node`` at any depth, except the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    yield stmt
                else:
                    yield from _import_nodes(stmt)
        else:
            yield from _import_nodes(child)


def _from_base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (relative imports resolved)."""
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join([*parts, node.module] if node.module else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    modules = package_modules(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in _import_nodes(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _from_base(name, is_package, node)
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def cycle_path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One closed path through a component: its first module back to itself (breadth-first)."""
    members = set(component)
    start = component[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parent:
                    parent[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"{component} is not strongly connected")


def describe(graph: dict[str, set[str]], found: list[list[str]]) -> str:
    return "\n".join(
        f"cycle of {len(c)} ({', '.join(c)}): {' -> '.join(cycle_path(graph, c))}" for c in found
    )


def test_no_import_cycles():
    graph = import_graph(PACKAGE_ROOT)
    found = cycles(graph)
    assert not found, "import cycles in dghard_cli:\n" + describe(graph, found)


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Folder -> the folders its modules import: the module graph with each module of a
    sub-package replaced by its top folder under the package (``engine``, ``io``, ...); the
    package's root modules (the public API, the commands' library functions) sit above every
    folder and are left out."""

    def folder(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 2 else None

    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        f = folder(module)
        if f is None:
            continue
        out.setdefault(f, set())
        for t in targets:
            ft = folder(t)
            if ft is not None and ft != f:
                out[f].add(ft)
                out.setdefault(ft, set())
    return out


def test_no_folder_level_cycles():
    """Folders import one way: a folder that needs another never is needed by it, directly or
    through others (8 of the 14 folders once formed one loop through four single lines)."""
    graph = folder_graph(import_graph(PACKAGE_ROOT))
    found = cycles(graph)
    assert not found, "folder-level import cycles in dghard_cli:\n" + describe(graph, found)


def test_a_folder_cycle_is_found_through_modules_that_are_not_cyclic(tmp_path):
    """Two folders whose modules import each other's *other* modules: no module cycle, a folder
    cycle; root modules are above the folders."""
    pkg = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/top.py": "from pkg.x import a\nfrom pkg.y import d\n",
            "pkg/x/__init__.py": "",
            "pkg/x/a.py": "from pkg.y import c\n",
            "pkg/x/b.py": "",
            "pkg/y/__init__.py": "",
            "pkg/y/c.py": "",
            "pkg/y/d.py": "from pkg.x import b\n",
        },
    )
    graph = import_graph(pkg)
    assert cycles(graph) == []
    folders = folder_graph(graph)
    assert folders == {"x": {"y"}, "y": {"x"}}
    assert cycles(folders) == [["x", "y"]]


def test_the_graph_sees_the_package():
    """The walk reads real edges (a graph with none would pass the test above trivially)."""
    graph = import_graph(PACKAGE_ROOT)
    assert len(graph) > 100
    assert "dghard_cli.engine.writer" in graph["dghard_cli.merging"]
    assert "dghard_cli.errors" in graph["dghard_cli.repairing"]


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root / "pkg"


def test_a_function_level_import_closes_a_cycle(tmp_path):
    pkg = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg.b import thing\n",
            "pkg/b.py": "def thing():\n    from . import a\n    return a\n",
        },
    )
    graph = import_graph(pkg)
    assert cycles(graph) == [["pkg.a", "pkg.b"]]
    assert cycle_path(graph, ["pkg.a", "pkg.b"]) == ["pkg.a", "pkg.b", "pkg.a"]
    assert "cycle of 2 (pkg.a, pkg.b): pkg.a -> pkg.b -> pkg.a" in describe(graph, cycles(graph))


def test_what_does_not_count_as_a_cycle(tmp_path):
    pkg = _write(
        tmp_path,
        {
            # the package imports its submodules; they import a sibling through the package:
            # an edge to the submodule only, not back to the package
            "pkg/__init__.py": "from pkg import a, b\n",
            "pkg/a.py": "from pkg import b\n",
            # an import only type checkers run
            "pkg/b.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from pkg.a import X\n"
                "else:\n    import pkg.sub.c\n"
            ),
            "pkg/sub/__init__.py": "",
            "pkg/sub/c.py": "from ..b import y  # relative: pkg.b\n",
        },
    )
    graph = import_graph(pkg)
    assert graph["pkg"] == {"pkg.a", "pkg.b"}
    assert graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.b"] == {"pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.b"}
    assert cycles(graph) == [["pkg.b", "pkg.sub.c"]]  # the else branch runs: a real cycle
