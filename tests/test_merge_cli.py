"""`dghard merge` on the command line: every shipped recipe, bad recipes, mismatched inputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import merge_reference as M
import numpy as np
import pytest
import torch
import yaml
from conftest import REPO, f64, load_dir, run_dghard
from reference import ref_filter, rel
from typer.testing import CliRunner

from dghard_cli.cli import app
from dghard_cli.engine.writer import RunOptions
from dghard_cli.errors import InputError
from dghard_cli.io.checkpoint import Checkpoint
from dghard_cli.merging import MergeOptions, merge
from dghard_cli.methods import dare as dare_mod
from dghard_cli.recipes.recipe import load_recipe
from dghard_cli.testing.synthetic import ArchConfig, make_pair

CFG = ArchConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2, vocab_size=256)
RECIPES = sorted(
    p for p in (REPO / "configs").glob("*.yaml") if not p.name.startswith("sweep-")
)  # sweep-*: candidate sets


def cli(*args):
    """The command line in this process (fast); the real subprocess is used where it matters."""
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """A copy of configs/ next to a generated examples/tiny pair, and another fine-tune."""
    root = tmp_path_factory.mktemp("merge-cli")
    make_pair(root / "examples" / "tiny", CFG, ft_shards=2, seed=1)
    make_pair(root / "other", CFG, ft_shards=1, seed=1, delta_seed=9)
    shutil.copytree(REPO / "configs", root / "configs")
    return root


def test_every_method_has_a_recipe():
    methods = {yaml.safe_load(p.read_text())["method"] for p in RECIPES}
    assert methods == {"wise-ft", "task-arithmetic", "ties", "dare-linear", "dare-ties", "recall", "dg-hard"}


def _reference(recipe: dict, report: dict, name: str, b: np.ndarray, f: np.ndarray) -> np.ndarray:
    method = recipe["method"]
    lam = recipe.get("lambda", 1.0)
    w = [m.get("weight", 1.0) if isinstance(m, dict) else 1.0 for m in recipe["models"]]
    if method == "wise-ft":
        return M.ref_wise_ft(b, f, recipe["alpha"])
    if method == "task-arithmetic":
        return M.ref_task_arithmetic(b, [f], w, lam)
    if method == "ties":
        return M.ref_ties(b, [f], w, recipe["density"], lam)
    if method in ("dare-linear", "dare-ties"):
        return M.ref_dare(
            b,
            [f],
            w,
            recipe["density"],
            lam,
            recipe["seed"],
            name,
            dare_mod.CHUNK,
            ties=method == "dare-ties",
        )
    if method == "dg-hard":
        if b.ndim == 2 and b.size >= recipe["min_numel"]:
            return b + lam * w[0] * ref_filter(f - b, scale=recipe["scale"])[0]
        return M.ref_task_arithmetic(b, [f], w, lam)
    if method == "recall":
        rec = next(r for r in report["tensors"] if r["name"] == name)
        alpha = rec["recall_weights"]
        return b + alpha[1] * (f - b)
    raise AssertionError(method)


@pytest.mark.parametrize("recipe_path", RECIPES, ids=lambda p: p.stem)
def test_shipped_recipe_runs_and_matches_reference(tree, recipe_path):
    recipe = yaml.safe_load(recipe_path.read_text())
    res = cli("merge", "--config", tree / "configs" / recipe_path.name, "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    out = (tree / "configs" / recipe["out"]).resolve()
    assert Path(doc["output"]["path"]).resolve() == out
    assert doc["method"] == recipe["method"]
    written = json.loads((out / "dghard_report.json").read_text())
    assert written["merge"] == doc["merge"]
    base = load_dir(tree / "examples" / "tiny" / "base")
    ft = load_dir(tree / "examples" / "tiny" / "ft")
    merged = load_dir(out)
    assert set(merged) == set(base)
    for name, b in base.items():
        ref = _reference(recipe, doc, name, f64(b), f64(ft[name]))
        assert rel(f64(merged[name]), ref) <= 1e-6, name
    if recipe["method"] == "recall":
        layers = doc["recall"]["layers"]
        assert [layer["group"] for layer in layers] == ["embed", "layer.0", "layer.1"]
        for layer in layers:
            assert len(layer["weights"]) == 2 and abs(sum(layer["weights"]) - 1) < 1e-12


def test_cli_overrides_recipe_and_weights(tree, tmp_path):
    out = tmp_path / "ta"
    res = cli(
        "merge",
        "--config",
        tree / "configs" / "task-arithmetic.yaml",
        "--weights",
        "-0.5",
        "--lambda",
        "2",
        "--out",
        out,
        "--quiet",
    )
    assert res.exit_code == 0, res.output
    assert res.stdout == ""
    doc = json.loads((out / "dghard_report.json").read_text())
    assert doc["parameters"]["weights"] == [-0.5] and doc["parameters"]["lambda"] == 2.0
    b = load_dir(tree / "examples" / "tiny" / "base")
    f = load_dir(tree / "examples" / "tiny" / "ft")
    m = load_dir(out)
    name = "model.layers.1.self_attn.o_proj.weight"
    assert rel(f64(m[name]), f64(b[name]) - (f64(f[name]) - f64(b[name]))) <= 1e-6


def test_two_finetunes_on_the_command_line(tree, tmp_path):
    base, ft, ft2 = tree / "examples/tiny/base", tree / "examples/tiny/ft", tree / "other/ft"
    res = cli(
        "merge",
        "--method",
        "ties",
        "--density",
        "0.2",
        "--weights",
        "1,1",
        base,
        ft,
        ft2,
        "--out",
        tmp_path / "m",
    )
    assert res.exit_code == 0, res.output
    assert "sign conflicts" in res.stdout
    doc = json.loads((tmp_path / "m" / "dghard_report.json").read_text())
    assert len(doc["inputs"]["fts"]) == 2
    assert doc["merge"]["kept_fraction"][0] == pytest.approx(0.2, abs=1e-3)


# -- bad input: exit 2, one line, nothing written ------------------------------------------


def _bad(tree: Path, name: str, text: str) -> Path:
    p = tree / "configs" / name
    p.write_text(text)
    return p


BAD_RECIPES = {
    "unknown-key": (
        "method: ties\nbase: ../examples/tiny/base\nmodels: [../examples/tiny/ft]\ndensty: 0.2\n",
        "unknown key 'densty'",
    ),
    "wrong-type": (
        "method: ties\nbase: ../examples/tiny/base\nmodels: [../examples/tiny/ft]\ndensity: high\n",
        "'density' must be a number",
    ),
    "missing-models": ("method: ties\nbase: ../examples/tiny/base\n", "missing 'models'"),
    "missing-model-key": (
        "method: ties\nbase: ../examples/tiny/base\nmodels:\n  - weight: 1\n",
        "missing 'model'",
    ),
    "model-not-found": (
        "method: ties\nbase: ../examples/tiny/base\nmodels: [../examples/tiny/nope]\n",
        "no such directory",
    ),
    "not-yaml": ("method: [ties\n", "not valid YAML"),
    "bad-method": (
        "method: average\nbase: ../examples/tiny/base\nmodels: [../examples/tiny/ft]\n",
        "is not one of",
    ),
    "not-applicable": (
        "method: wise-ft\nbase: ../examples/tiny/base\nmodels: [../examples/tiny/ft]\ndensity: 0.3\n",
        "--density does not apply",
    ),
    "bool-as-number": (
        "method: ties\nbase: ../examples/tiny/base\nmodels: [../examples/tiny/ft]\nlambda: true\n",
        "'lambda' must be a number",
    ),
    "bad-recall-key": (
        "method: recall\nbase: ../examples/tiny/base\nmodels: [../examples/tiny/ft]\nrecall: {temp: 1}\n",
        "unknown key 'temp'",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_RECIPES))
def test_bad_recipes_are_one_line_errors(tree, tmp_path, case):
    text, message = BAD_RECIPES[case]
    path = _bad(tree, f"bad-{case}.yaml", text)
    out = tmp_path / "never"
    res = CliRunner().invoke(app, ["merge", "--config", str(path), "--out", str(out)])
    assert res.exit_code == 2, (res.output, res.exception)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("dghard: error:"), res.stderr
    assert message in lines[0]
    assert "Traceback" not in res.output
    assert not out.exists()


def test_bad_recipe_through_the_real_cli(tree, tmp_path):
    path = _bad(tree, "bad-real.yaml", BAD_RECIPES["unknown-key"][0])
    res = run_dghard("merge", "--config", path, "--out", tmp_path / "o")
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "unknown key 'densty'" in res.stderr
    assert res.stdout == "" and not (tmp_path / "o").exists()


def test_relative_paths_resolve_against_the_recipe(tree, tmp_path):
    r = load_recipe(tree / "configs" / "ties.yaml")
    assert Path(r.base.spec).resolve() == (tree / "examples/tiny/base").resolve()
    assert Path(r.values["out"]).resolve() == (tree / "out/ties").resolve()
    hub = _bad(tree, "hub.yaml", "method: ties\nbase: org/base-model\nmodels: [org/ft-model]\n")
    assert load_recipe(hub).base.spec == "org/base-model"


def test_mismatched_architectures_name_the_first_differing_tensor(tree, tmp_path):
    make_pair(
        tmp_path / "wide",
        ArchConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=256),
    )
    ref = Checkpoint(tree / "examples/tiny/ft")
    out = tmp_path / "o"
    res = run_dghard(
        "merge",
        "--method",
        "task-arithmetic",
        tree / "examples/tiny/base",
        tree / "examples/tiny/ft",
        tmp_path / "wide" / "ft",
        "--out",
        out,
    )
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1
    wide = Checkpoint(tmp_path / "wide" / "ft")
    first = next(n for n, t in ref.tensors.items() if wide.tensors[n].shape != t.shape)
    assert f"tensor {first!r}" in res.stderr and "fine-tune #2" in res.stderr
    assert not out.exists() and not any(tmp_path.glob("o.*"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--method", "wise-ft", "--alpha", "1.5"], "--alpha must be in [0, 1]"),
        (["--method", "ties", "--weights", "1,1"], "--weights has 2 value(s) but 1 fine-tune"),
        (["--method", "ties", "--weights", "-1"], "weights >= 0"),
        (["--method", "dare-ties", "--density", "0"], "--density"),
        (["--method", "task-arithmetic", "--seed", "3"], "--seed does not apply"),
        (["--method", "ties", "--weights", "1,x"], "'x' is not a number"),
        (["--method", "recall", "--recall-kernel", "dot"], "--recall-kernel 'dot'"),
        (["--method", "ties", "--dtype", "int8"], "--dtype"),
    ],
)
def test_bad_options_are_one_line_errors(tree, tmp_path, args, message):
    out = tmp_path / "never"
    res = CliRunner().invoke(
        app,
        ["merge", *args, str(tree / "examples/tiny/base"), str(tree / "examples/tiny/ft"), "--out", str(out)],
    )
    assert res.exit_code == 2, res.output
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], res.stderr
    assert not out.exists()


def test_wise_ft_needs_exactly_one_finetune(tree, tmp_path):
    with pytest.raises(InputError, match="one fine-tune"):
        merge(
            tree / "examples/tiny/base",
            [tree / "examples/tiny/ft", tree / "other/ft"],
            tmp_path / "o",
            MergeOptions(method="wise-ft", run=RunOptions(device="cpu")),
        )
    assert not (tmp_path / "o").exists()


def test_dry_run_reads_headers_only(tree, tmp_path):
    res = cli(
        "merge",
        "--method",
        "recall",
        tree / "examples/tiny/base",
        tree / "examples/tiny/ft",
        "--out",
        tmp_path / "o",
        "--dry-run",
        "--json",
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["summary"]["dry_run"] and doc["summary"]["actions"] == {"method": 21}
    assert "recall" not in doc and not (tmp_path / "o").exists()


def test_excluded_and_dtype_options(tree, tmp_path):
    out = tmp_path / "o"
    doc = merge(
        tree / "examples/tiny/base",
        [tree / "examples/tiny/ft", tree / "other/ft"],
        out,
        MergeOptions(
            method="task-arithmetic",
            run=RunOptions(device="cpu"),
            policy=__import__("dghard_cli.engine.plan", fromlist=["PolicyOptions"]).PolicyOptions(
                exclude=["lm_head"], out_dtype="BF16"
            ),
        ),
    )
    merged = load_dir(out)
    ft = load_dir(tree / "examples/tiny/ft")
    assert merged["lm_head.weight"].dtype == torch.bfloat16
    assert torch.equal(merged["lm_head.weight"], ft["lm_head.weight"].to(torch.bfloat16))
    rec = next(r for r in doc["tensors"] if r["name"] == "lm_head.weight")
    assert rec["action"] == "kept-ft" and rec["reason"] == "excluded"


def test_nan_in_a_finetune_is_exit_2_naming_it(tree, tmp_path):
    from dghard_cli.testing.synthetic import write_checkpoint

    ft = load_dir(tree / "examples/tiny/ft")
    name = "model.layers.1.mlp.up_proj.weight"
    ft[name][3, 5] = float("nan")
    write_checkpoint(tmp_path / "bad", sorted(ft.items()), config=CFG.to_hf("float32"))
    out = tmp_path / "o"
    res = cli(
        "merge", "--method", "ties", tree / "examples/tiny/base", tree / "examples/tiny/ft", tmp_path / "bad",
        "--out", out, "--quiet",
    )  # fmt: skip
    assert res.exit_code == 2, res.output
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and name in lines[0] and "fine-tune #2" in lines[0] and "NaN" in lines[0]
    assert not out.exists() and not any(tmp_path.glob("o.*"))


def test_report_outside_out_carries_the_merge_summary(tree, tmp_path):
    rp = tmp_path / "report.json"
    res = cli(
        "merge", "--method", "dare-linear", "--density", "0.5", tree / "examples/tiny/base",
        tree / "examples/tiny/ft", "--out", tmp_path / "o", "--report", rp, "--quiet",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    doc = json.loads(rp.read_text())
    assert doc["merge"]["kept_fraction"][0] == pytest.approx(0.5, abs=0.01)
    assert not (tmp_path / "o" / "dghard_report.json").exists()
