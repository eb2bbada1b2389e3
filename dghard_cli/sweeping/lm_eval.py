"""``dghard sweep --lm-eval TASKS``: lm-evaluation-harness as the sweep's evaluation command.

The sweep runs an evaluation command template (:mod:`dghard_cli.sweeping.evaluate`); this module
writes that template for lm-evaluation-harness, so ``--lm-eval arc_easy,hellaswag`` stands for

    PYTHON -m lm_eval --model hf --model_args pretrained={model} --tasks arc_easy,hellaswag \\
        --output_path {output} --device cpu [--lm-eval-args ...]

where PYTHON is this interpreter (lm_eval must be installed next to dghard:
``pip install 'dghard[lm-eval]'``). lm-eval writes ``{output}/<model>/results_<time>.json``,
which the sweep reads like any lm-eval results file (the newest ``results*.json`` under
``{output}``, each task's metric chosen by :mod:`dghard_cli.scoring.results`).

:func:`check` refuses, before anything runs, what would make every evaluation fail: lm_eval
not importable here, ``--lm-eval-model vllm`` without vllm, a task lm-eval does not know. Task
names are looked up in a child interpreter (lm-eval's ``TaskManager``), first among the
``--include_path`` tasks only (about 2 s), and among lm-eval's built-in tasks (some 14 000
YAML files: about 10-15 s more) only when a name is not found there.

Nothing here imports torch or lm_eval at module level.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dghard_cli.errors import InputError
from dghard_cli.sweeping.lm_eval_options import check_as_lm_eval_reads, model_arg_keys, option_table

#: The backends ``--lm-eval-model`` accepts.
BACKENDS = ("hf", "vllm")

#: lm-eval options the template sets itself (long and short spellings): refused in --lm-eval-args.
_OWNED = {
    "--model": "--lm-eval-model",
    "-M": "--lm-eval-model",
    "--tasks": "--lm-eval",
    "-t": "--lm-eval",
    "--output_path": "the sweep ({output})",
    "-o": "the sweep ({output})",
    "--device": "the sweep's --device",
}
_MODEL_ARGS = ("--model_args", "-a")
_INSTALL = "pip install 'dghard[lm-eval]'"
#: Seconds the task lookup may take (lm-eval indexes every built-in task's YAML file).
CHECK_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class LmEvalSpec:
    """What ``--lm-eval``, ``--lm-eval-args`` and ``--lm-eval-model`` ask for."""

    tasks: tuple[str, ...]
    args: tuple[str, ...] = ()  # passed to lm_eval as given (shlex-split), less --model_args
    model: str = "hf"
    model_args: str = ""  # the user's --model_args, appended after pretrained={model}

    @classmethod
    def parse(
        cls, tasks: Iterable[str] | str, args: str | None = None, model: str | None = None
    ) -> LmEvalSpec:
        """InputError (exit 2) for an empty task list, an unknown backend, unbalanced quotes or
        an option the template sets itself."""
        if isinstance(tasks, str):
            tasks = [tasks]
        names: list[str] = []
        for t in tasks:
            names += [x.strip() for x in str(t).split(",") if x.strip()]
        if not names:
            raise InputError("--lm-eval: no task given; e.g. --lm-eval arc_easy,hellaswag")
        model = (model or "hf").strip()
        if model not in BACKENDS:
            raise InputError(f"--lm-eval-model {model!r} is not one of {', '.join(BACKENDS)}")
        try:
            words = shlex.split(args or "")
        except ValueError as exc:
            raise InputError(f"--lm-eval-args {args!r}: {exc}") from None
        rest: list[str] = []
        model_args: list[str] = []
        i = 0
        while i < len(words):
            w = words[i]
            name, eq, value = w.partition("=") if w.startswith("--") else (w, "", "")
            if name in _OWNED:
                raise InputError(
                    f"--lm-eval-args: {name} is set by {_OWNED[name]}; leave it out of --lm-eval-args"
                )
            spelled = [o for o in (*_OWNED, *_MODEL_ARGS) if o.startswith("--") and o.startswith(name)]
            if name.startswith("--") and name not in (*_OWNED, *_MODEL_ARGS) and len(name) > 3 and spelled:
                # lm_eval's argument parser takes abbreviations: --out would be --output_path
                raise InputError(f"--lm-eval-args: {name} abbreviates {' or '.join(spelled)}; spell it out")
            if name in _MODEL_ARGS:
                if not eq:
                    i += 1
                    if i >= len(words):
                        raise InputError(f"--lm-eval-args: {name} needs a value (key=value,...)")
                    value = words[i]
                if "pretrained" in model_arg_keys([value]):
                    raise InputError(
                        "--lm-eval-args: --model_args pretrained=... is set by the sweep (each candidate's directory)"
                    )
                if value.strip().startswith("{"):  # a JSON object: lm-eval merges it over the template's
                    rest += [name, value]
                else:
                    model_args.append(value.strip(","))
            else:
                rest.append(w)
            i += 1
        check_as_lm_eval_reads(words)
        for n in names:
            _check_task_path(n)
        return cls(tuple(dict.fromkeys(names)), tuple(rest), model, ",".join(a for a in model_args if a))

    def include_path(self) -> str | None:
        """The ``--include_path`` given in the pass-through arguments (the last one), if any."""
        found = None
        for i, w in enumerate(self.args):
            if w == "--include_path" and i + 1 < len(self.args):
                found = self.args[i + 1]
            elif w.startswith("--include_path="):
                found = w.split("=", 1)[1]
        return found

    def describe(self) -> dict:
        """What the sweep report records."""
        return {
            "tasks": list(self.tasks),
            "model": self.model,
            "model_args": self.model_args or None,
            "args": list(self.args),
        }


#: What lm-eval loads a task from when the name is a path.
_TASK_FILE_SUFFIXES = (".yaml", ".yml")


def _check_task_path(name: str) -> None:
    """A task name that names a file must be a task YAML (lm-eval loads nothing else): ``--lm-eval
    notes.txt`` counted as a task and failed every evaluation after the sweep had started."""
    p = Path(name).expanduser()
    looks_like_path = (
        os.sep in name or name.startswith(".") or p.suffix.lower() in (*_TASK_FILE_SUFFIXES, ".txt", ".json")
    )
    try:
        is_file, exists = p.is_file(), p.exists()
    except (OSError, ValueError):  # a name no file system can look up (too long, a NUL)
        is_file = exists = False
    if is_file and p.suffix.lower() not in _TASK_FILE_SUFFIXES:
        raise InputError(
            f"--lm-eval {name[:200]}: a file that is not a task YAML; lm-eval loads tasks from .yaml files, "
            "directories of them, or task names"
        )
    if looks_like_path and not exists and not any(c in name for c in "*?["):
        raise InputError(f"--lm-eval {name[:200]}: no such task file or directory")


def check(spec: LmEvalSpec, *, python: str | None = None) -> None:
    """InputError (exit 2) when the evaluations could not run: lm_eval (or vllm, if asked) is
    not importable by this interpreter, the ``--include_path`` does not exist, or a task name
    is unknown to lm-eval (named, with close names)."""
    if importlib.util.find_spec("lm_eval") is None:
        raise InputError(f"--lm-eval: lm-evaluation-harness is not installed here ({_INSTALL})")
    option_table()  # refuses an lm-eval without an option the evaluation command passes
    if spec.model == "vllm" and importlib.util.find_spec("vllm") is None:
        raise InputError("--lm-eval-model vllm: vllm is not installed here (pip install vllm), or use hf")
    include = spec.include_path()
    if include is not None and not Path(include).expanduser().exists():
        raise InputError(f"--lm-eval-args: --include_path {include}: no such file or directory")
    unknown, close, known = unknown_tasks(spec.tasks, include, python=python)
    if unknown:
        name = unknown[0]
        hint = f"did you mean {', '.join(close[name])}? " if close.get(name) else ""
        where = f" nor in --include_path {include}" if include else ""
        more = f" (and {len(unknown) - 1} more unknown: {', '.join(unknown[1:])})" if len(unknown) > 1 else ""
        raise InputError(
            f"--lm-eval: lm-eval knows no task {name!r} among its {known} tasks{where}{more}; {hint}"
            f"'{Path(sys.executable).name} -m lm_eval ls tasks' lists them"
        )


# The lookup, run by a child interpreter: importing lm_eval's TaskManager pulls in datasets,
# pandas and more, and indexing the built-in tasks takes seconds; none of it stays in this
# process. It prints one JSON line: {"unknown": [...], "close": {name: [...]}, "known": N}.
_LOOKUP = r"""
import difflib, fnmatch, json, logging, os, sys
logging.disable(logging.WARNING)
names, include = json.loads(sys.argv[1])
from lm_eval.tasks import TaskManager

def known(tm):
    return [t for t in tm.all_tasks]

def missing(all_tasks):
    have = set(all_tasks)
    out = []
    for n in names:
        if n in have or os.path.isfile(n) or os.path.isdir(n):
            continue
        if any(c in n for c in "*?[") and fnmatch.filter(all_tasks, n):
            continue
        out.append(n)
    return out

tasks = []
left = names
if include is not None:
    try:
        tasks = known(TaskManager(include_path=include, include_defaults=False))
    except TypeError:  # an lm-eval without include_defaults
        tasks = []
    left = missing(tasks)
if left:
    tasks = known(TaskManager(include_path=include))
    left = missing(tasks)
close = {n: difflib.get_close_matches(n, tasks, n=3, cutoff=0.6) for n in left}
print(json.dumps({"unknown": left, "close": close, "known": len(tasks)}))
"""


def unknown_tasks(
    tasks: Iterable[str], include_path: str | None = None, *, python: str | None = None
) -> tuple[list[str], dict[str, list[str]], int]:
    """(names lm-eval does not know, close names for each, how many tasks it knows).

    A name counts as known when it is a task, group or tag lm-eval has indexed (built in or
    under ``include_path``), a glob pattern matching one, or an existing YAML file/directory.
    Runs ``python`` (default: this interpreter) with lm-eval's TaskManager.
    """
    payload = json.dumps([list(tasks), include_path])
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")  # indexing never needs the Hub
    try:
        proc = subprocess.run(
            [python or sys.executable, "-c", _LOOKUP, payload],
            capture_output=True,
            text=True,
            timeout=CHECK_TIMEOUT_S,
            env=env,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise InputError(
            f"--lm-eval: looking up the task names took over {CHECK_TIMEOUT_S:g} s; is lm-eval installed correctly?"
        ) from None
    last = proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else []
    try:
        doc = json.loads(last[0]) if proc.returncode == 0 and last else None
    except json.JSONDecodeError:
        doc = None
    if not isinstance(doc, dict):
        err = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        raise InputError(
            f"--lm-eval: lm-eval could not list its tasks ({err[-1] if err else f'exit {proc.returncode}'}); "
            f"{_INSTALL}"
        )
    return list(doc["unknown"]), dict(doc["close"]), int(doc["known"])


def template(spec: LmEvalSpec, device: str) -> str:
    """The sweep's evaluation command template (with ``{model}`` and ``{output}``) that runs
    lm-evaluation-harness on ``spec.tasks`` with this interpreter, on ``device`` ("cuda:0" when
    each evaluation is given its own GPU, else the sweep's resolved --device)."""
    model_args = "pretrained={model}" + ("," + shlex.quote(spec.model_args) if spec.model_args else "")
    words = [
        shlex.quote(sys.executable),
        "-m lm_eval",
        f"--model {spec.model}",
        f"--model_args {model_args}",
        "--tasks " + shlex.quote(",".join(spec.tasks)),
        "--output_path {output}",
        "--device " + shlex.quote(device),
        *(shlex.quote(a) for a in spec.args),
    ]
    return " ".join(words)


def resolve(
    eval_cmd: str | None,
    tasks: list[str] | None,
    args: str | None,
    model: str | None,
    device: str,
    *,
    own_gpu: bool = False,
) -> tuple[str, dict | None]:
    """The sweep's ``(eval_template, lm_eval description or None)`` from the command line:
    exactly one of ``--eval`` and ``--lm-eval``; with ``--lm-eval``, the spec checked and its
    template written for ``device`` (a --device value: auto resolves to cuda:0 or cpu), or for
    cuda:0 when each evaluation is given a GPU of its own (``own_gpu``: ``--devices``, or Ray's
    gpu resource, set CUDA_VISIBLE_DEVICES to it, whatever this machine has)."""
    if eval_cmd is not None and tasks:
        raise InputError("--eval and --lm-eval are both given; evaluate with one of them")
    if eval_cmd is None and not tasks:
        for name, v in (("--lm-eval-args", args), ("--lm-eval-model", model)):
            if v is not None:
                raise InputError(f"{name} needs --lm-eval TASKS")
        raise InputError(
            "give an evaluation: --eval 'CMD {model} {output}' or --lm-eval TASKS (lm-evaluation-harness)"
        )
    if eval_cmd is not None:
        for name, v in (("--lm-eval-args", args), ("--lm-eval-model", model)):
            if v is not None:
                raise InputError(f"{name} goes with --lm-eval, not --eval")
        return eval_cmd, None
    spec = LmEvalSpec.parse(tasks or [], args, model)
    from dghard_cli.engine.device import resolve_device

    dev = "cuda:0" if own_gpu else str(resolve_device(device))
    check(spec)
    return template(spec, dev), {**spec.describe(), "device": dev}
