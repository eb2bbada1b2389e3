"""What `dghard sweep` tells the user: candidates that cannot win are marked, a missing frontier
plot says why (on screen and in sweep_report.json), the printed command runs verbatim."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from conftest import run_dghard
from test_sweep import Pair

from dghard_cli.sweeping import plot as sweep_plot
from dghard_cli.sweeping import report as sweep_report
from dghard_cli.sweeping.run import SweepOptions
from dghard_cli.sweeping.state import SweepState


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Pair:
    return Pair(tmp_path_factory.mktemp("sweep output"))


def test_targets_marks_no_plot_reason_and_a_verbatim_reproduce_command(pair, tmp_path):
    b = tmp_path / "b.json"
    b.write_text(json.dumps(pair.base_scores))
    f = tmp_path / "f.json"
    f.write_text(json.dumps(pair.ft_scores))
    cands = tmp_path / "c.yaml"
    cands.write_text(
        "families:\n  - {family: hard, grid: [1.0, 3.0, 6.0], refine: false}\n"
        "  - {family: wise-ft, grid: [0.5], refine: false}\n"
    )
    out = tmp_path / "swept"
    args = ["sweep", pair.base, pair.ft, out, "--eval", pair.template, "--candidates", cands]
    args += ["--base-results", b, "--ft-results", f, "--budget", "4", "--target", "task"]
    r = run_dghard(*args, "--min-target-retention", "95", env={"COLUMNS": "400"})
    assert r.returncode == 0, r.stderr
    doc = json.loads((out / "sweep_report.json").read_text())
    # 1. progress lines: a candidate below the target bar says it cannot win
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("[dghard] sweep ") and "HM" in ln]
    assert len(lines) == 4, r.stderr
    by_name = {c["name"]: c for c in doc["candidates"]}
    marked = 0
    for ln in lines:
        # the candidate the line is about (the line also names the best so far, after " · ")
        name = next(n for n in by_name if f" {n} (" in ln.split(" · ")[0])
        if by_name[name]["feasible"]:
            assert "cannot win" not in ln, ln
        else:
            marked += 1
            worst = by_name[name]["target_retention"]["task"]
            assert f"cannot win: target retention {worst:.1f} % is below --min-target-retention 95 %" in ln
    assert 0 < marked < 4
    # 2. no frontier plot (HM is % repair alone here: the task is a target): the report says why
    assert doc["plot"] is None
    assert doc["plot_skipped"].startswith("% repair or % retention is undefined")
    assert "no frontier plot: % repair or % retention is undefined" in " ".join(doc["warnings"])
    assert "warning: no frontier plot" in r.stdout
    # 3. the printed command, run as printed, writes the winner's bytes beside OUT
    (cmd,) = [ln[len("reproduce: ") :] for ln in r.stdout.splitlines() if ln.startswith("reproduce: ")]
    argv = shlex.split(cmd)
    assert argv[0] == "dghard" and argv == doc["winner"]["reproduce"]["argv"]
    again = Path(str(out) + "-reproduced")
    assert f"writes a copy to {again}" in r.stdout
    rr = run_dghard(*argv[1:])
    assert rr.returncode == 0, rr.stderr
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert shards and shards == sorted(p.name for p in again.glob("*.safetensors"))
    for name in shards:
        assert (out / name).read_bytes() == (again / name).read_bytes(), name


def test_a_plot_without_matplotlib_gives_its_reason(tmp_path, monkeypatch):
    def no_matplotlib(*args, **kwargs):
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(sweep_plot, "frontier_png", no_matplotlib)
    s = SweepState.create("b", "f", tmp_path / "out", SweepOptions(eval_template="x {model} {output}"))
    assert sweep_report.plot(s, tmp_path, None) == (
        None,
        "matplotlib is not installed (pip install 'dghard[plot]')",
    )
