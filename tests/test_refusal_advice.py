"""A refusal advises only options the command it comes from has.

``dghard merge`` refused a NaN checkpoint with "pass --allow-nonfinite", which only ``repair``
has; an overflow of ``repair --lines`` advised ``--weights``. Advice that names options is
structured (:class:`dghard_cli.errors.Advice`) and the CLI renders it with the running
command's options. Checked two ways: every option any message or advice of the package names
is an option of some command (read statically from the source), and the refusals of each
command, provoked here, name only that command's options.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
import typer
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import dghard_cli
from dghard_cli.cli import app
from dghard_cli.errors import KEEP_NONFINITE, Advice, InputError
from dghard_cli.testing.synthetic import ArchConfig, make_pair

CFG = ArchConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, vocab_size=64)
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*(?!\w)")


def command_options() -> dict[str, set[str]]:
    group = typer.main.get_command(app)
    return {
        name: {o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}
        for name, cmd in group.commands.items()  # type: ignore[attr-defined]
    }


def _message_strings(tree: ast.AST):
    """String constants of what an error says: inside ``raise`` statements, ``Advice(...)``
    calls and ``hint=``/``advice=`` arguments."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            roots = [node.exc]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", "")) == "Advice"
        ):
            roots = [node]
        elif isinstance(node, ast.keyword) and node.arg in ("hint", "advice"):
            roots = [node.value]
        else:
            continue
        for root in roots:
            for sub in ast.walk(root):
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                    yield sub


#: Modules whose messages name another tool's options on purpose (lm-eval's --model, --tasks).
OTHER_TOOLS = ("sweeping/lm_eval.py", "sweeping/lm_eval_options.py")


def test_every_option_an_error_names_exists():
    """Any ``--option`` in what an error of the package says (its message, advice or hint) is
    an option of a command."""
    every = set().union(*command_options().values()) | {"--help", "--version"}
    unknown: dict[str, list[str]] = {}
    root = Path(dghard_cli.__file__).parent
    for path in sorted(root.rglob("*.py")):
        where = str(path.relative_to(root))
        if where in OTHER_TOOLS:
            continue
        for node in _message_strings(ast.parse(path.read_text())):
            for option in OPTION.findall(node.value):
                if option not in every:
                    unknown.setdefault(option, []).append(f"{where}:{node.lineno}")
    assert not unknown, unknown
    assert set(KEEP_NONFINITE.options) <= every


@pytest.fixture(scope="module")
def nan_pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("nan")
    make_pair(root, CFG, dtype="float32", base_shards=1, ft_shards=1, seed=0)
    ft = root / "ft"
    shard = next(ft.glob("*.safetensors"))
    tensors = load_file(shard)
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name][0, 0] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    return root / "base", ft


def refusal(*args) -> str:
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert r.exit_code == 2, (r.exit_code, r.output)
    return " ".join(r.output.split())


def names_only_its_options(command: str, message: str) -> None:
    mine = command_options()[command]
    assert set(OPTION.findall(message)) <= mine, (
        command,
        sorted(set(OPTION.findall(message)) - mine),
        message,
    )


@pytest.mark.parametrize("method", ["task-arithmetic", "ties", "tsv", "dg-hard", "star"])
def test_a_nan_refusal_of_merge_does_not_advise_an_option_merge_lacks(nan_pair, tmp_path, method):
    base, ft = nan_pair
    msg = refusal("merge", "--method", method, base, ft, ft, "--out", tmp_path / "o")
    assert "NaN" in msg and "fix the checkpoint" in msg and "--allow-nonfinite" not in msg, msg
    names_only_its_options("merge", msg)


@pytest.mark.parametrize("extra", [[], ["--lines", "0.5,0.5"]])
def test_a_nan_refusal_of_repair_advises_its_allow_nonfinite(nan_pair, tmp_path, extra):
    base, ft = nan_pair
    msg = refusal("repair", base, ft, tmp_path / "o", *extra)
    assert "or pass --allow-nonfinite to keep such tensors as they are" in msg, msg
    names_only_its_options("repair", msg)


def test_an_overflow_advises_the_strengths_each_command_has(tmp_path):
    make_pair(tmp_path, CFG, dtype="float32", base_shards=1, ft_shards=1, seed=0)
    base, ft = tmp_path / "base", tmp_path / "ft"
    msg = refusal("repair", base, ft, tmp_path / "o", "--lines", "1e308,1e308", "--dtype", "fp32")
    assert "lower the strengths (--lines, --layer-strengths" in msg, msg
    names_only_its_options("repair", msg)
    msg = refusal(
        "merge",
        "--method",
        "task-arithmetic",
        "--weights",
        "1e300,1e300",
        base,
        ft,
        ft,
        "--out",
        tmp_path / "m",
    )
    assert "lower the strengths (--lambda, --alpha, --weights, --lines, --layer-strengths" in msg, msg
    names_only_its_options("merge", msg)


def test_advice_renders_the_offered_options_and_pickles():
    import pickle

    e = InputError("x is NaN; fix the checkpoint", advice=KEEP_NONFINITE)
    assert (
        str(e) == "x is NaN; fix the checkpoint, or pass --allow-nonfinite to keep such tensors as they are"
    )
    assert e.text_for(frozenset({"--out"})) == "x is NaN; fix the checkpoint"
    a = Advice(("--a", "--b"), "change {options}", sep="; ")
    assert InputError("m", advice=a).text_for(frozenset({"--b"})) == "m; change --b"
    assert str(pickle.loads(pickle.dumps(e))) == str(e)
    assert torch is not None
