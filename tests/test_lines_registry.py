"""The layer-strength schedule as a parameter every merge method takes (methods/declare.py
COMMON): merge's options, recipe keys and report parameters derive from its declaration, the two
spellings of one field cannot both be given, and repair's options carry the same help."""

from __future__ import annotations

import json

import pytest
from conftest import run_dghard
from typer.testing import CliRunner

from dghard_cli import MergeOptions
from dghard_cli.cli import app
from dghard_cli.errors import InputError
from dghard_cli.methods import registry
from dghard_cli.methods.declare import COMMON, LAYER_STRENGTHS, LINES
from dghard_cli.recipes.recipe import load_recipe, top_keys
from dghard_cli.schedule.spec import LayerSchedule, parse_layer_strengths
from dghard_cli.testing.synthetic import ArchConfig, make_pair

CFG = ArchConfig(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=3)


def test_every_method_takes_the_schedule_once():
    # the schedule's two spellings, then the SVC post-step's two parameters
    assert [p.name for p in COMMON] == ["lines", "layer_strengths", "calibrate", "svc_alpha"]
    for m in registry.methods().values():
        assert m.all_params[-4:] == ("lines", "layer_strengths", "calibrate", "svc_alpha")
    assert registry.recipe_keys()["lines"] == registry.recipe_keys()["layer_strengths"] == "schedule"
    assert "lines" in top_keys() and "layer_strengths" in top_keys()
    assert "lines" not in [p.name for p in registry.scalar_params()]  # not a sweep axis of merge


def test_the_options_are_the_declarations():
    merge_help = CliRunner().invoke(app, ["merge", "--help"], terminal_width=200).output
    repair_help = CliRunner().invoke(app, ["repair", "--help"], terminal_width=200).output
    for text in (merge_help, repair_help):
        assert text.count("--lines") >= 1 and text.count("--layer-strengths") >= 1
    assert LINES.cli_flag == "--lines" and LAYER_STRENGTHS.cli_flag == "--layer-strengths"
    assert LayerSchedule(0.2, 0.5).argv() == ["--lines", "0.2,0.5"]


def test_resolve_reports_the_spelling_given():
    p = registry.resolve(MergeOptions(method="ties", schedule=LayerSchedule(0.2, 0.6)), 2)
    assert p["lines"] == [0.2, 0.6] and "layer_strengths" not in p
    g = parse_layer_strengths("embed=0.1,0-2=0.4,head=1")
    p = registry.resolve(MergeOptions(method="wise-ft", schedule=g), 1)
    assert p["layer_strengths"] == "embed=0.1,0-2=0.4,head=1.0" and "lines" not in p
    p = registry.resolve(MergeOptions(method="ties"), 2)
    assert "lines" not in p and "layer_strengths" not in p  # an unscheduled report is unchanged


def test_two_spellings_of_one_field_are_not_both_given():
    with pytest.raises(InputError, match="give either --lines or --layer-strengths, not both"):
        registry.options_values(
            {"lines": LayerSchedule(0.1, 0.2), "layer_strengths": parse_layer_strengths("embed=1,0=1,head=1")}
        )
    kwargs, extra = registry.options_values({"lines": LayerSchedule(0.1, 0.2), "layer_strengths": None})
    assert kwargs["schedule"].alpha == 0.1 and extra == {}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lines-registry")
    base, ft1 = make_pair(root / "a", CFG, ft_shards=2, seed=4)
    _, ft2 = make_pair(root / "b", CFG, ft_shards=1, seed=4, delta_seed=8)
    return base, [ft1, ft2]


def _recipe(tmp_path, models, extra: str):
    base, fts = models
    r = tmp_path / "sub" / "r.yaml"
    r.parent.mkdir(parents=True, exist_ok=True)
    r.write_text(
        f"method: ties\nbase: {base}\nmodels:\n  - {fts[0]}\n  - {fts[1]}\nout: {tmp_path / 'o'}\n{extra}"
    )
    return r


def test_recipe_file_of_strengths_is_relative_to_the_recipe(tmp_path, models):
    r = _recipe(tmp_path, models, "layer_strengths: strengths.yaml\n")
    (r.parent / "strengths.yaml").write_text("embed: 0.2\n0-2: 0.5\nhead: 1\n")
    assert load_recipe(r).values["layer_strengths"] == str(r.parent / "strengths.yaml")
    res = run_dghard("merge", "--config", r, "--dry-run", "--json", "--device", "cpu")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["parameters"]["layer_strengths"] == "embed=0.2,0-2=0.5,head=1.0"
    assert doc["layer_strengths"]["layers"] == [0.5, 0.5, 0.5]


def test_command_line_schedule_overrides_the_recipe_and_recipe_errors_name_it(tmp_path, models):
    r = _recipe(tmp_path, models, "layer_strengths: {embed: 0.2, 0-2: 0.5, head: 1}\n")
    res = run_dghard("merge", "--config", r, "--lines", "0.1,0.3", "--dry-run", "--json", "--device", "cpu")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["parameters"]["lines"] == [0.1, 0.3] and "layer_strengths" not in doc["parameters"]
    bad = _recipe(tmp_path, models, "lines: [1, 2, 3]\n")
    res = run_dghard("merge", "--config", bad, "--dry-run", "--device", "cpu")
    assert res.returncode == 2
    assert f"recipe {bad}: 'lines' must be two numbers [A, B]" in res.stderr
    res = run_dghard(
        "merge",
        "--method",
        "ties",
        "--lines",
        "0.1,0.2",
        "--layer-strengths",
        "embed=1,0-2=1,head=1",
        models[0],
        *models[1],
        "--out",
        tmp_path / "x",
        "--dry-run",
    )
    assert res.returncode == 2 and "not both" in res.stderr
