"""The forgetting benchmark's miniature scenario: deterministic build, eval JSON that score reads."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from conftest import REPO, run_dghard

from dghard_cli.scoring.results import load_results


def _bench():
    spec = importlib.util.spec_from_file_location(
        "forgetting_bench", REPO / "scripts" / "forgetting_bench.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_tiny_build_is_deterministic_and_eval_is_scored(tmp_path: Path) -> None:
    fb = _bench()
    assert fb.main(["build", str(tmp_path / "a"), "--tiny", "--seed", "3"]) == 0
    assert fb.main(["build", str(tmp_path / "b"), "--tiny", "--seed", "3"]) == 0
    for name in ("base", "ft"):
        a = (tmp_path / "a" / name / "model.safetensors").read_bytes()
        assert a == (tmp_path / "b" / name / "model.safetensors").read_bytes()
        assert (tmp_path / "a" / name / "tokenizer.json").is_file()
    out = tmp_path / "ft-eval.json"
    assert fb.main(["eval", str(tmp_path / "a" / "ft"), str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc) == {*fb.SKILLS, fb.TARGET}
    assert all(0 <= v["score"] <= 100 and v["stderr"] > 0 for v in doc.values())
    assert set(load_results(out)) == set(doc)
    assert doc == json.loads((tmp_path / "a" / "ft.json").read_text())  # build's own evaluation
    res = run_dghard(
        "score", "--base", tmp_path / "a" / "base.json", "--ft", out, "--candidate", f"c={out}", "--json"
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["candidates"][0]["name"] == "c"
