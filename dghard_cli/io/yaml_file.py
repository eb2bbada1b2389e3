"""A small YAML input file (a recipe, a candidates file, a ``--layer-strengths`` file), read
through :mod:`dghard_cli.io.files` and parsed with the alias limits of :mod:`dghard_cli.io.limits`."""

from __future__ import annotations

import os
from pathlib import Path

from dghard_cli.errors import InputError
from dghard_cli.io import files
from dghard_cli.io.checkpoint import path_exists
from dghard_cli.io.limits import MAX_DEPTH, MAX_JSON_ELEMENTS, check_depth_and_size, parse_yaml


def read_yaml_file(path: Path, where: str, limit: int) -> object:
    """A small YAML file read with ``yaml.safe_load`` only (no tag ever runs); a one-line
    InputError naming ``where`` when it is missing, not a regular file (a FIFO, a device), too
    large, not UTF-8, not YAML, or when its aliases expand past the limits of
    :func:`dghard_cli.io.limits.parse_yaml` (an alias bomb)."""
    import yaml

    if not path_exists(path) and not os.path.lexists(path):
        raise InputError(f"{where}: no such file")
    size = f"{limit >> 20} MiB" if limit % (1 << 20) == 0 else f"{limit} bytes"
    with files.open_input(path, what="YAML file", roots=None) as fh:
        if fh.size > limit:
            raise InputError(f"{where}: larger than {size}; it should be a short YAML file")
        try:
            data = fh.read(limit + 1)
        except OSError as exc:
            raise InputError(f"{where}: cannot read ({exc.strerror})") from None
    if len(data) > limit:
        raise InputError(f"{where}: larger than {size}; it should be a short YAML file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{where}: cannot read as UTF-8 text ({exc})") from None
    try:
        doc = parse_yaml(text, where)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InputError(f"{where}: not valid YAML{at} ({problem})") from None
    # every number in it is read as a float somewhere: no 10^400, no .nan or .inf
    check_depth_and_size(doc, where, max_depth=MAX_DEPTH, max_elements=MAX_JSON_ELEMENTS, finite=True)
    return doc
