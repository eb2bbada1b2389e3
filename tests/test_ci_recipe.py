"""The post-fine-tune CI recipe (examples/ci/post_finetune.sh), run for real with bash."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, f64, load_dir

from dghard_cli.testing.synthetic import ArchConfig, make_pair

SCRIPT = REPO / "examples" / "ci" / "post_finetune.sh"

# A stand-in for the team's evaluation: scores that depend on the weights in a known way.
# e = share of the fine-tune's update energy a model carries, sum ||W - W_base||^2 / sum ||W_ft - W_base||^2
# (0 for the base, 1 for the fine-tune). Forgetting grows with e, the task skill with sqrt(e).
EVAL_STUB = """
import json, sys
from pathlib import Path
import numpy as np
from safetensors.numpy import load_file

def load(d):
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out

model, output, base_dir, ft_dir = sys.argv[1:5]
b, f, m = load(base_dir), load(ft_dir), load(model)
num = sum(float(np.sum((m[k].astype(np.float64) - b[k]) ** 2)) for k in b if b[k].ndim == 2)
den = sum(float(np.sum((f[k].astype(np.float64) - b[k]) ** 2)) for k in b if b[k].ndim == 2)
e = num / den
Path(output).write_text(json.dumps(
    {"arith": 60 - 20 * e, "trivia": 70 - 30 * e, "task": 30 + 40 * e ** 0.5, "other": 50.0}
))
"""

# A dghard wrapper that records its calls and answers audit-lora (a separate command) itself.
WRAPPER = """#!/usr/bin/env bash
echo "$*" >> "$CALLS"
if [[ $1 == audit-lora ]]; then echo '{"findings": []}'; exit "${AUDIT_RC:-0}"; fi
exec "$PY" -m dghard_cli "$@"
"""


def energy_share(base: Path, ft: Path, model: Path) -> float:
    b, f, m = load_dir(base), load_dir(ft), load_dir(model)
    num = sum(float(np.sum((f64(m[k]) - f64(b[k])) ** 2)) for k in b if b[k].ndim == 2)
    den = sum(float(np.sum((f64(f[k]) - f64(b[k])) ** 2)) for k in b if b[k].ndim == 2)
    return num / den


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    if shutil.which("bash") is None:
        pytest.skip("bash is not available")
    root = tmp_path_factory.mktemp("ci")
    base, ft = make_pair(root / "pair", ArchConfig(), dtype="float32", ft_shards=2, seed=7)
    stub = root / "eval_stub.py"
    stub.write_text(EVAL_STUB)
    wrapper = root / "dghard"
    wrapper.write_text(WRAPPER)
    wrapper.chmod(0o755)
    eval_cmd = f"{shlex.quote(sys.executable)} {shlex.quote(str(stub))} {{model}} {{output}} " + " ".join(
        shlex.quote(str(p)) for p in (base, ft)
    )
    return {"root": root, "base": base, "ft": ft, "eval": eval_cmd, "wrapper": wrapper}


def run_script(setup, out: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.update(
        {
            "HF_HUB_OFFLINE": "1",
            "DGHARD": str(setup["wrapper"]),
            "PY": sys.executable,
            "CALLS": str(out.parent / f"{out.name}.calls"),
            "BASE": str(setup["base"]),
            "FT": str(setup["ft"]),
            "EVAL": setup["eval"],
            "OUT": str(out),
        }
    )
    e.update(env)
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=e, capture_output=True, text=True, timeout=300, cwd=out.parent
    )


def test_recipe_passes_a_low_bar_and_collects_artifacts(setup):
    out = setup["root"] / "run1"
    r = run_script(setup, out, "--fail-under", "20")
    assert r.returncode == 0, r.stdout + r.stderr
    art = out / "artifacts"
    assert "audit-lora skipped" in r.stdout and "gate passed" in r.stdout
    for name in ("dghard_report.json", "repair.html", "score.json", "eval/base", "eval/ft", "eval/repaired"):
        assert (art / name).is_file(), name
    assert "data:image/png;base64," in (art / "repair.html").read_text()
    calls = (out.parent / "run1.calls").read_text().splitlines()
    assert [c.split()[0] for c in calls] == ["repair", "report", "score"]
    # the score is what the stand-in's formula gives for the repaired weights
    e = energy_share(setup["base"], setup["ft"], out / "repaired")
    assert 0.3 < e < 0.95
    doc = json.loads((art / "score.json").read_text())
    cand = doc["candidates"][0]
    assert cand["name"] == "repaired"
    assert cand["repair"] == pytest.approx(100 * (1 - e), abs=1e-6)  # (c - f)/(b - f) = 1 - e
    assert cand["retention"] == pytest.approx(100 * e**0.5, abs=1e-6)
    hm = 2 * 100 * (1 - e) * 100 * e**0.5 / (100 * (1 - e) + 100 * e**0.5)
    assert cand["hm"] == pytest.approx(hm, abs=1e-6)
    assert doc["gate"] == {
        "fail_under": 20.0,
        "candidate": "repaired",
        "hm": cand["hm"],
        "passed": True,
        "reason": doc["gate"]["reason"],
    }
    assert {b["name"]: b["partition"] for b in doc["benchmarks"]} == {
        "arith": "damaged",
        "trivia": "damaged",
        "task": "improved",
        "other": "unchanged",
    }


def test_recipe_fails_the_gate_below_the_threshold(setup):
    first = setup["root"] / "run1" / "artifacts" / "eval"
    if not (first / "ft").exists():
        pytest.skip("needs the first run's evaluation results")
    out = setup["root"] / "run2"
    # an adapter is given: audit-lora runs first; base/ft results are reused from the first run
    r = run_script(
        setup,
        out,
        "--fail-under",
        "90",
        "--adapter",
        str(setup["root"] / "adapter"),
        BASE_RESULTS=str(first / "base"),
        FT_RESULTS=str(first / "ft"),
        HTML="0",
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "gate failed" in r.stderr and "below --fail-under 90" in r.stderr
    calls = (out.parent / "run2.calls").read_text().splitlines()
    assert calls[0].startswith(f"audit-lora {setup['root'] / 'adapter'} --base {setup['base']}")
    assert [c.split()[0] for c in calls] == ["audit-lora", "repair", "score"]  # HTML=0: no page
    doc = json.loads((out / "artifacts" / "score.json").read_text())
    assert doc["gate"]["passed"] is False and doc["gate"]["hm"] < 90
    assert not (out / "artifacts" / "eval" / "base").exists()  # reused, not re-evaluated
    # a failing audit stops the job before the repair
    r = run_script(setup, setup["root"] / "run3", "--adapter", "x", AUDIT_RC="1")
    assert r.returncode == 1 and "audit-lora exited 1" in r.stderr
    assert not (setup["root"] / "run3" / "repaired").exists()


def test_recipe_usage_errors(setup, tmp_path):
    r = run_script(setup, tmp_path / "o", EVAL="")
    assert r.returncode == 2 and "EVAL is not set" in r.stderr
    r = run_script(setup, tmp_path / "o", EVAL="evaluate {model}")
    assert r.returncode == 2 and "{output}" in r.stderr
    r = run_script(setup, tmp_path / "o", "--fail-under", "high")
    assert r.returncode == 2 and "not a number" in r.stderr


def test_github_workflow_runs_the_script_and_uploads_artifacts():
    import yaml

    doc = yaml.safe_load((REPO / "examples" / "ci" / "github-actions.yml").read_text())
    triggers = doc.get("on", doc.get(True))  # YAML 1.1 reads a bare `on` as true
    assert {"workflow_dispatch", "workflow_call"} <= set(triggers)
    job = doc["jobs"]["gate"]
    assert (REPO / job["env"]["SCRIPT"]) == SCRIPT
    assert "{model}" in job["env"]["EVAL"] and "{output}" in job["env"]["EVAL"]
    for key in ("BASE", "FT", "ADAPTER", "FAIL_UNDER", "TARGETS"):
        assert job["env"][key].startswith("${{ inputs.")  # inputs reach the shell via the environment
    runs = [s.get("run", "") for s in job["steps"]]
    assert any('bash "$SCRIPT"' in r for r in runs)
    assert any("dghard[plot]" in r for r in runs)
    upload = next(s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact"))
    assert upload["if"] == "always()"
    assert upload["with"]["path"].rstrip("/") == "dghard-ci/artifacts"
    assert job["env"]["OUT"].endswith("/dghard-ci")
