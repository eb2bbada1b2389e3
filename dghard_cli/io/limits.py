"""Bounded parsers: JSON with depth and element limits, YAML with alias limits.

A file's size is limited where it is opened (:mod:`dghard_cli.io.files`); these limits bound
what a small file can still make the tool do: nesting that exhausts the interpreter's stack
(``[[[[…]]]]``: a RecursionError deep inside the parser), documents with millions of elements
that later code walks, and YAML aliases that expand a few hundred bytes into billions of nodes
(the "billion laughs"). Every violation is a one-line :class:`InputError` naming the file.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable

from dghard_cli.errors import InputError

#: Deepest nesting accepted in a JSON or YAML document (configs nest 3–5 levels).
MAX_DEPTH = 64
#: Most values (objects, arrays, strings, numbers) in one JSON document.
MAX_JSON_ELEMENTS = 4_000_000
#: Most nodes a YAML document may have once every alias is expanded.
MAX_YAML_NODES = 100_000
#: Most alias references in one YAML document.
MAX_YAML_ALIASES = 1_000


#: The largest magnitude a number read from a file may have: every number dghard reads becomes a
#: float somewhere, and an integer beyond this (``1`` followed by 400 zeros) cannot.
MAX_NUMBER = sys.float_info.max


def _key_path(node: tuple | None, key: object) -> str:
    parts = [key]
    while node is not None:
        node, k = node
        parts.append(k)
    parts = [p for p in reversed(parts) if p is not None]
    return "".join(
        f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(parts)
    )


def bad_number(v: object, *, finite: bool) -> str | None:
    """Why ``v`` is not a number dghard can read (None when it is, or is not a number at all)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return "an integer too large for a float" if abs(v) > MAX_NUMBER else None
    if finite and isinstance(v, float) and not math.isfinite(v):
        return f"{v} (not a finite number)"
    return None


def check_depth_and_size(
    doc: object, where: str, *, max_depth: int, max_elements: int, finite: bool = False
) -> None:
    """Walk a parsed document without recursion; InputError when it nests or grows past the
    limits, or holds a number no float can hold (an integer past ±1.8·10^308; with ``finite``
    also NaN and ±Inf), naming its key. Keys are checked as well as values."""
    if not isinstance(doc, (dict, list)):
        why = bad_number(doc, finite=finite)
        if why:
            raise InputError(f"{where}: the value is {why}")
        return
    stack: list[tuple[dict | list, int, tuple | None]] = [(doc, 1, None)]
    seen = 1
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, dict):
            items = value.items()
            seen += len(value)
        else:
            items = enumerate(value)
            seen += len(value)
        if seen > max_elements:
            raise InputError(f"{where}: more than {max_elements} values; refusing to process it")
        for k, c in items:
            if isinstance(c, (dict, list)):
                if depth + 1 > max_depth:
                    raise InputError(
                        f"{where}: nested deeper than {max_depth} levels; refusing to process it"
                    )
                stack.append((c, depth + 1, (path, k)))
            elif ((type(c) is int or type(c) is float) and (why := bad_number(c, finite=finite))) or (
                type(k) is not str and (why := bad_number(k, finite=finite))
            ):
                raise InputError(f"{where}: {_key_path(path, k)} is {why}; refusing to read it")


def parse_json(
    data: bytes | str,
    where: str,
    *,
    max_depth: int = MAX_DEPTH,
    max_elements: int = MAX_JSON_ELEMENTS,
    object_pairs_hook: Callable | None = None,
    finite: bool = False,
) -> object:
    """``json.loads`` with the depth and element limits; InputError naming ``where`` otherwise."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        doc = json.loads(text, object_pairs_hook=object_pairs_hook)
    except RecursionError:
        raise InputError(f"{where}: nested deeper than {max_depth} levels; refusing to process it") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"{where}: not valid JSON ({exc})") from None
    check_depth_and_size(doc, where, max_depth=max_depth, max_elements=max_elements, finite=finite)
    return doc


def _yaml_children(node) -> list:
    import yaml

    if isinstance(node, yaml.MappingNode):
        return [x for pair in node.value for x in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def check_yaml_graph(root, where: str, *, max_nodes: int, max_depth: int, aliases: int) -> None:
    """Count the nodes of a composed YAML document as if every alias were expanded.

    Aliases make the composed graph share nodes; the expanded size of a shared node is computed
    once (memoised), so the check costs one pass over the graph however large the expansion.
    A node reachable from itself (a recursive alias) is refused.
    """
    if aliases > MAX_YAML_ALIASES:
        raise InputError(f"{where}: more than {MAX_YAML_ALIASES} YAML aliases; refusing to expand them")
    size: dict[int, int] = {}
    height: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[object, int, bool]] = [(root, 1, False)]
    deep = f"{where}: nested deeper than {max_depth} levels; refusing to process it"
    while stack:
        node, depth, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            children = _yaml_children(node)
            total = 1 + sum(size[id(c)] for c in children)
            if total > max_nodes:
                raise InputError(
                    f"{where}: expands to more than {max_nodes} YAML nodes (aliases of aliases?); "
                    "refusing to expand it"
                )
            size[key] = total
            height[key] = 1 + max((height[id(c)] for c in children), default=0)
            continue
        if key in size:  # a shared node (an alias) seen before: its subtree is known
            if depth + height[key] - 1 > max_depth:
                raise InputError(deep)
            continue
        if key in on_path:
            raise InputError(f"{where}: a YAML alias refers to a node that contains it (recursive alias)")
        if depth > max_depth:
            raise InputError(deep)
        on_path.add(key)
        stack.append((node, depth, True))
        for child in _yaml_children(node):
            stack.append((child, depth + 1, False))


def parse_yaml(
    text: str, where: str, *, max_nodes: int = MAX_YAML_NODES, max_depth: int = MAX_DEPTH
) -> object:
    """``yaml.safe_load`` (no tag ever runs) with the alias, node and depth limits.

    The document is composed first (aliases become shared nodes, which costs nothing), checked,
    and only then constructed into Python objects.
    """
    import yaml

    class _CountingLoader(yaml.SafeLoader):
        aliases = 0

        def compose_node(self, parent, index):  # type: ignore[override]
            if self.check_event(yaml.AliasEvent):
                type(self).aliases += 1
            return super().compose_node(parent, index)

    loader = _CountingLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise InputError(
                f"{where}: nested deeper than {max_depth} levels; refusing to process it"
            ) from None
        if node is None:
            return None
        check_yaml_graph(
            node, where, max_nodes=max_nodes, max_depth=max_depth, aliases=_CountingLoader.aliases
        )
        try:
            return loader.construct_document(node)
        except RecursionError:
            raise InputError(
                f"{where}: nested deeper than {max_depth} levels; refusing to process it"
            ) from None
        except (ValueError, OverflowError) as exc:
            # a scalar YAML resolves but Python cannot build: an integer past the interpreter's
            # integer-string limit (5000 digits), a timestamp of month 13
            raise InputError(f"{where}: a value that cannot be read ({str(exc).split(';')[0]})") from None
    finally:
        loader.dispose()
