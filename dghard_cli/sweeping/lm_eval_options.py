"""``--lm-eval-args`` read exactly as the installed lm-eval reads them.

The sweep's lm-eval template sets the model, its ``pretrained=`` directory, the tasks, the
output path and the device; ``--lm-eval-args`` may set anything else. What lm-eval would read
as one of the template's settings is refused, in every spelling its argument parser accepts
(``-oDIR``, ``-o=DIR``, an abbreviation ``--o``, ``-apretrained=x``, flags joined to an option
``-wMvllm``) and in every form of model arguments it reads (``key=value`` lists and JSON
objects, whose keys lm-eval merges over the template's: ``-a='{"pretrained": "decoy"}'``).

The option table is the installed lm-eval's own, read from its ``run`` parser in a child
interpreter (no torch, a fraction of a second, once a process). Where it cannot be read, the
table below stands in for the release it was copied from and only for it; any other release is
refused in one line, since its options may differ.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from dghard_cli.errors import InputError

#: The lm-eval release whose ``run`` options :data:`BUILT_IN_OPTIONS` lists (the pinned one).
BUILT_IN_RELEASE = "0.4.13"

#: lm-eval 0.4.13's ``run`` options (``lm_eval/_cli/run.py``): option strings and nargs (0: a flag).
BUILT_IN_OPTIONS: tuple[tuple[tuple[str, ...], int | str | None], ...] = (
    (("--config", "-C"), None), (("--tasks", "-t"), "+"), (("--model", "-M"), None),
    (("--model_args", "-a"), "+"), (("--apply_chat_template",), "?"), (("--limit", "-L"), None),
    (("--use_cache", "-c"), None), (("--num_fewshot", "-f"), None), (("--batch_size", "-b"), None),
    (("--max_batch_size",), None), (("--device",), None), (("--gen_kwargs",), "+"),
    (("--output_path", "-o"), None), (("--log_samples", "-s"), 0), (("--samples", "-E"), None),
    (("--cache_requests",), "?"), (("--check_integrity",), 0), (("--system_instruction",), None),
    (("--fewshot_as_multiturn",), "?"), (("--include_path",), None), (("--verbosity", "-v"), None),
    (("--write_out", "-w"), 0), (("--show_config",), 0), (("--wandb_args",), "+"),
    (("--wandb_config_args",), "+"), (("--trackio_args",), "+"), (("--hf_hub_log_args",), "+"),
    (("--predict_only", "-x"), 0), (("--seed",), None), (("--trust_remote_code",), 0),
    (("--confirm_run_unsafe_code",), 0), (("--metadata",), "+"),
)  # fmt: skip

#: What the template owns, by lm-eval's destination (``--config`` could set any of them).
OWNED_DESTS = {
    "model": ("--model", "--lm-eval-model"),
    "tasks": ("--tasks", "--lm-eval"),
    "output_path": ("--output_path", "the sweep ({output})"),
    "device": ("--device", "the sweep's --device"),
    "config": ("--config", "the sweep (a config file can set the model, tasks and output path)"),
}
#: The options the template itself writes: an installed lm-eval without them cannot run it.
TEMPLATE_OPTIONS = ("--model", "--model_args", "--tasks", "--output_path", "--device")

Table = tuple[tuple[tuple[str, ...], int | str | None], ...]

# Run by a child interpreter: builds lm-eval's `run` parser (lm_eval._cli, no torch) and prints
# {"version": V, "options": [[option strings, nargs], ...]} or {"version": V, "error": "..."}.
_READ = r"""
import argparse, json, importlib.metadata as m
out = {"version": m.version("lm_eval")}
try:
    from lm_eval._cli.run import Run
    parser = Run(argparse.ArgumentParser().add_subparsers())._parser
    out["options"] = [
        [list(a.option_strings), a.nargs]
        for a in parser._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction)
    ]
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def _valid_table(options: object) -> Table | None:
    if not isinstance(options, list) or not options:
        return None
    table = []
    for item in options:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], list) and item[0]):
            return None
        opts, nargs = item
        if not all(isinstance(o, str) and o.startswith("-") for o in opts):
            return None
        if not (nargs is None or isinstance(nargs, str) or (isinstance(nargs, int) and nargs >= 0)):
            return None
        table.append((tuple(opts), nargs))
    return tuple(table)


def read_installed(python: str | None = None) -> tuple[str | None, Table | None, str | None]:
    """(installed lm-eval version, its ``run`` option table, why it could not be read)."""
    try:
        proc = subprocess.run(
            [python or sys.executable, "-c", _READ],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, None, f"{type(exc).__name__}"
    lines = proc.stdout.strip().splitlines()
    try:
        doc = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    except json.JSONDecodeError:
        doc = None
    if not isinstance(doc, dict):
        err = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        return None, None, err[-1] if err else f"exit {proc.returncode}"
    version = doc.get("version") if isinstance(doc.get("version"), str) else None
    table = _valid_table(doc.get("options"))
    return version, table, None if table else str(doc.get("error") or "an option table of an unknown form")


@dataclass(frozen=True)
class Options:
    """The installed lm-eval's ``run`` options: ``table`` None where they could not be read."""

    version: str
    table: Table | None
    why: str = ""


@cache
def option_table() -> Options:
    """The ``run`` options of the lm-eval that the template runs (this interpreter's).

    The installed release's own table; :data:`BUILT_IN_OPTIONS` where lm-eval is not installed
    (the sweep refuses that before it runs anything) or where the table cannot be read from
    the release it was copied from; no table where another release's cannot be read.
    InputError for a release without an option the template writes."""
    from importlib.util import find_spec

    if find_spec("lm_eval") is None:
        return Options(BUILT_IN_RELEASE, BUILT_IN_OPTIONS)
    version, table, why = read_installed()
    version = version or "(unknown version)"
    if table is None:
        return Options(version, BUILT_IN_OPTIONS if version == BUILT_IN_RELEASE else None, why or "")
    have = {o for opts, _ in table for o in opts}
    missing = [o for o in TEMPLATE_OPTIONS if o not in have]
    if missing:
        raise InputError(
            f"--lm-eval: the installed lm-eval {version} has no {', '.join(missing)}, which the sweep's "
            f"evaluation command passes; install lm-eval=={BUILT_IN_RELEASE}"
        )
    return Options(version, table)


def mirror_parser(table: Table) -> argparse.ArgumentParser:
    """An argument parser that reads options as lm-eval's ``run`` parser does."""

    class Parser(argparse.ArgumentParser):
        def error(self, message: str):  # type: ignore[override]
            raise InputError(f"--lm-eval-args: lm-eval would refuse it ({message})")

    parser = Parser(add_help=False, allow_abbrev=True, exit_on_error=False)
    for opts, nargs in table:
        if nargs == 0:
            parser.add_argument(*opts, action="store_true", default=argparse.SUPPRESS)
        else:
            const = True if nargs == "?" else None
            parser.add_argument(*opts, nargs=nargs, const=const, action="append", default=argparse.SUPPRESS)
    return parser


def model_arg_keys(values: Sequence[str]) -> list[str]:
    """The keys lm-eval reads from one ``--model_args`` occurrence's values, as its
    ``MergeDictAction`` does: the first value as a JSON object where it is one (escapes decoded,
    as ``json.loads`` does; a first value with ``{`` that is not JSON is refused, as lm-eval
    refuses it), else every value's ``key=value`` pairs (``chat_template_args={...}`` included).
    A ``key=value`` list is split at its top-level commas, as lm-eval splits it."""
    vals = [str(v).strip() for v in values]
    if not vals:
        return []
    rest = vals
    try:
        obj = json.loads(vals[0])
    except (ValueError, RecursionError):
        if "{" in vals[0]:
            raise InputError(
                f"--lm-eval-args: lm-eval would refuse the model arguments {vals[0][:80]!r} (not valid JSON)"
            ) from None
        obj = None
    keys: list[str] = []
    if isinstance(obj, dict):
        return [str(k).strip() for k in obj]  # lm-eval merges the object and ignores the rest
    for v in rest:
        for item in _top_level_items(v):
            if "=" not in item:
                raise InputError(
                    f"--lm-eval-args: lm-eval would refuse the model argument {item[:80]!r} (expected key=value)"
                )
            keys.append(item.split("=", 1)[0].strip())
    return keys


def _top_level_items(text: str) -> list[str]:
    """``text`` split at the commas outside brackets, braces and quotes (how lm-eval splits a
    ``key=value,...`` list, so ``chat_template_args={"a":1,"b":2}`` is one item)."""
    items, start, depth, quote = [], 0, 0, ""
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[({":
            depth += 1
        elif ch in "])}":
            depth = max(depth - 1, 0)
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [it for it in items if it]


def _refuse_pretrained(keys: list[str], word: str) -> None:
    if "pretrained" in keys:
        raise InputError(
            f"--lm-eval-args: {word} sets --model_args pretrained=..., which the sweep sets "
            "(each candidate's directory)"
        )


def check_as_lm_eval_reads(words: list[str]) -> None:
    """InputError when lm-eval would read ``words`` as setting what the template owns, in any
    spelling its argument parser accepts (each option word is parsed alone to name it)."""
    if not words:
        return
    options = option_table()
    if options.table is None:
        raise InputError(
            f"--lm-eval-args: cannot read the options of the installed lm-eval {options.version} "
            f"({options.why}), and this dghard knows those of {BUILT_IN_RELEASE} only; "
            f"install lm-eval=={BUILT_IN_RELEASE} or leave out --lm-eval-args"
        )
    parser = mirror_parser(options.table)
    for w in words:
        if not w.startswith("-") or w == "-" or w == "--":
            continue
        try:
            ns, _ = parser.parse_known_args([w, "x"])
        except (InputError, argparse.ArgumentError):
            ns = argparse.Namespace()
        for dest, (option, owner) in OWNED_DESTS.items():
            if hasattr(ns, dest):
                raise InputError(
                    f"--lm-eval-args: {w} is lm-eval's {option}, which is set by {owner}; leave it out"
                )
        for values in getattr(ns, "model_args", []):
            given = [v for v in values if v != "x"]  # "x": the placeholder value of this pass
            if given:
                _refuse_pretrained(model_arg_keys(given), w)
    # the whole list, as lm-eval reads it: --model_args takes several values (nargs "+"), so
    # "--model_args dtype=x pretrained=y" sets pretrained too; and what lm-eval would refuse
    try:
        ns, _ = parser.parse_known_args(words)
    except argparse.ArgumentError as exc:  # an option without its value: lm-eval exits with it
        raise InputError(f"--lm-eval-args: lm-eval would refuse it ({exc})") from None
    for vs in getattr(ns, "model_args", []):
        _refuse_pretrained(model_arg_keys(vs), "--model_args")
