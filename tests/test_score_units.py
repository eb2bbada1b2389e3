"""``dghard score --units`` (was ``--scale``, kept as a hidden deprecated alias)."""

from __future__ import annotations

import json

from conftest import run_dghard


def _files(tmp_path):
    paths = []
    for name, doc in (("b", {"x": 0.5, "y": 0.6}), ("f", {"x": 0.8, "y": 0.4}), ("c", {"x": 0.7, "y": 0.55})):
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(doc))
        paths.append(p)
    b, f, c = paths
    return ["score", "--base", b, "--ft", f, "--candidate", c, "--json"]


def test_units_and_its_deprecated_alias_agree(tmp_path):
    common = _files(tmp_path)
    units = run_dghard(*common, "--units", "points")
    alias = run_dghard(*common, "--scale", "points")
    assert units.returncode == alias.returncode == 0, units.stderr + alias.stderr
    assert json.loads(units.stdout)["inputs"]["base"]["scale"] == "points"
    assert json.loads(units.stdout)["candidates"] == json.loads(alias.stdout)["candidates"]
    auto = json.loads(run_dghard(*common).stdout)
    assert auto["inputs"]["base"]["scale"] == "fraction"


def test_units_errors_name_the_new_flag(tmp_path):
    common = _files(tmp_path)
    bad = run_dghard(*common, "--units", "percent")
    assert bad.returncode == 2 and "--units 'percent' is not one of" in bad.stderr
    both = run_dghard(*common, "--units", "points", "--scale", "fraction")
    assert both.returncode == 2 and "old name of --units" in both.stderr
    helptext = run_dghard("score", "--help").stdout
    assert "--units" in helptext and "--scale" not in helptext
