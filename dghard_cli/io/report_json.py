"""The one serializer of every JSON document dghard writes (reports, ``--json`` output, the
sweep's records and report, ``score --report``).

JSON has no NaN or Infinity: Python's ``json.dumps`` writes the literals ``NaN`` and
``Infinity`` by default, which no strict parser (``jq``, JavaScript, Go) reads. Here a
non-finite float becomes ``null`` (a value that is not a number has no number to report) and
the document is then dumped with ``allow_nan=False``, so a literal can never slip through.
"""

from __future__ import annotations

import json
import math


def finite_json(obj: object) -> object:
    """``obj`` with every non-finite float (NaN, ±Inf) replaced by None, without recursion."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if not isinstance(obj, (dict, list, tuple)):
        return obj
    root: list = [obj]
    stack: list[tuple[object, dict | list, object]] = [(obj, root, 0)]
    while stack:
        value, parent, key = stack.pop()
        if isinstance(value, float):
            parent[key] = value if math.isfinite(value) else None  # type: ignore[index]
        elif isinstance(value, dict):
            new: dict = {}
            parent[key] = new  # type: ignore[index]
            for k, v in value.items():
                new[k] = v
                stack.append((v, new, k))
        elif isinstance(value, (list, tuple)):
            lst = list(value)
            parent[key] = lst  # type: ignore[index]
            for i, v in enumerate(lst):
                stack.append((v, lst, i))
    return root[0]


def json_text(doc: object, *, indent: int | None = 2, **dumps) -> str:
    """``doc`` as strict JSON text (no NaN/Infinity literals) followed by a newline."""
    return json.dumps(finite_json(doc), indent=indent, allow_nan=False, **dumps) + "\n"
