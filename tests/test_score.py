"""``dghard score`` against hand-computed values on lm-evaluation-harness result layouts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import run_dghard

from dghard_cli.errors import InputError
from dghard_cli.scoring.metrics import combined_stderr, harmonic_mean, score_candidates
from dghard_cli.scoring.results import MetricRule, Score, load_results, read_results
from dghard_cli.scoring.run import score_files


def lm_eval_doc(scores: dict[str, tuple], *, model: str = "hf") -> dict:
    """A results file laid out as lm-evaluation-harness 0.4 writes it.

    ``scores``: task -> (fraction, stderr) for the metric that represents it. Each task also
    carries the sibling metrics a real file has (acc next to acc_norm, gsm8k's two filters,
    mmlu's subtasks, "N/A" stderr on a group aggregate), so the metric choice is exercised.
    """
    results: dict = {}
    hib: dict = {}
    arc, arc_se = scores["arc_easy"]
    results["arc_easy"] = {
        "alias": "arc_easy",
        "acc,none": arc + 0.03,  # acc_norm represents the task, not acc
        "acc_stderr,none": 0.0088,
        "acc_norm,none": arc,
        "acc_norm_stderr,none": arc_se,
    }
    hib["arc_easy"] = {"acc": True, "acc_norm": True}
    hs, hs_se = scores["hellaswag"]
    results["hellaswag"] = {
        "alias": "hellaswag",
        "acc,none": hs - 0.1,
        "acc_stderr,none": 0.0049,
        "acc_norm,none": hs,
        "acc_norm_stderr,none": hs_se,
    }
    hib["hellaswag"] = {"acc": True, "acc_norm": True}
    g, g_se = scores["gsm8k"]
    results["gsm8k"] = {
        "alias": "gsm8k",
        "exact_match,strict-match": g,
        "exact_match_stderr,strict-match": g_se,
        "exact_match,flexible-extract": g + 0.02,
        "exact_match_stderr,flexible-extract": 0.0137,
    }
    hib["gsm8k"] = {"exact_match": True}
    mm, mm_se = scores["mmlu"]
    results["mmlu"] = {"acc,none": mm, "acc_stderr,none": mm_se, "alias": "mmlu"}
    results["mmlu_humanities"] = {"acc,none": mm - 0.05, "acc_stderr,none": "N/A", "alias": " - humanities"}
    results["mmlu_formal_logic"] = {"alias": "  - formal_logic", "acc,none": 0.3, "acc_stderr,none": 0.04}
    results["mmlu_stem"] = {"acc,none": mm + 0.02, "acc_stderr,none": 0.008, "alias": " - stem"}
    results["mmlu_abstract_algebra"] = {
        "alias": "  - abstract_algebra",
        "acc,none": 0.31,
        "acc_stderr,none": 0.05,
    }
    tq, tq_se = scores["truthfulqa_mc2"]
    results["truthfulqa_mc2"] = {"alias": "truthfulqa_mc2", "acc,none": tq, "acc_stderr,none": tq_se}
    md, md_se = scores["medqa_4options"]
    results["medqa_4options"] = {
        "alias": "medqa_4options",
        "acc,none": md,
        "acc_stderr,none": md_se,
        "acc_norm,none": md,
        "acc_norm_stderr,none": md_se,
    }
    results["wikitext"] = {
        "alias": "wikitext",
        "word_perplexity,none": 12.5,
        "word_perplexity_stderr,none": "N/A",
        "bits_per_byte,none": 0.66,
        "bits_per_byte_stderr,none": "N/A",
    }
    hib["wikitext"] = {"word_perplexity": False, "byte_perplexity": False, "bits_per_byte": False}
    return {
        "results": results,
        "groups": {"mmlu": dict(results["mmlu"])},
        "group_subtasks": {
            "mmlu_humanities": ["mmlu_formal_logic"],
            "mmlu_stem": ["mmlu_abstract_algebra"],
            "mmlu": ["mmlu_humanities", "mmlu_stem"],
            "arc_easy": [],
            "hellaswag": [],
            "gsm8k": [],
            "truthfulqa_mc2": [],
            "medqa_4options": [],
            "wikitext": [],
        },
        "configs": {t: {"task": t, "num_fewshot": 0} for t in results},
        "versions": {t: 1.0 for t in results},
        "n-shot": {t: 0 for t in results},
        "higher_is_better": hib,
        "n-samples": {t: {"original": 1000, "effective": 1000} for t in results},
        "config": {"model": model, "model_args": "pretrained=x", "batch_size": "auto"},
        "git_hash": "abc1234",
        "date": 1717000000.0,
    }


# Points: base and fine-tune (with stderr), chosen so each partition is exercised.
BASE = {
    "arc_easy": (0.700, 0.0090),
    "hellaswag": (0.600, 0.0050),
    "gsm8k": (0.400, 0.0135),
    "mmlu": (0.600, 0.0040),
    "truthfulqa_mc2": (0.450, 0.0150),
    "medqa_4options": (0.300, 0.0120),
}
FT = {
    "arc_easy": (0.650, 0.0095),  # -5.0; margin 2·sqrt(0.9²+0.95²) = 2.6173 -> damaged
    "hellaswag": (0.590, 0.0050),  # -1.0; margin 2·sqrt(0.5²+0.5²) = 1.4142 -> unchanged
    "gsm8k": (0.550, 0.0137),  # +15;  margin 2·sqrt(1.35²+1.37²) = 3.8467 -> improved
    "mmlu": (0.585, 0.0040),  # -1.5; margin 2·sqrt(0.4²+0.4²) = 1.1314 -> damaged
    "truthfulqa_mc2": (0.470, 0.0150),  # +2.0; margin 4.2426 -> unchanged
    "medqa_4options": (0.500, 0.0130),  # target
}


def write_json(path: Path, doc: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))
    return path


@pytest.fixture()
def files(tmp_path):
    base = write_json(tmp_path / "base" / "results_2024-06-01T10-00-00.123456.json", lm_eval_doc(BASE))
    ft = write_json(tmp_path / "ft.json", lm_eval_doc(FT))
    # R1 as an lm-eval output directory (model subfolder, timestamped file; an older run too)
    r1_dir = tmp_path / "r1_out"
    r1 = {k: (v, 0.01) for k, v in {"arc_easy": 0.68, "hellaswag": 0.595, "gsm8k": 0.52}.items()}
    r1.update({"mmlu": (0.595, 0.004), "truthfulqa_mc2": (0.46, 0.015), "medqa_4options": (0.47, 0.013)})
    write_json(r1_dir / "__models__r1" / "results_2024-06-02T09-00-00.000001.json", lm_eval_doc(r1))
    stale = {k: (0.0, 0.01) for k in r1}
    write_json(r1_dir / "__models__r1" / "results_2024-06-01T09-00-00.000001.json", lm_eval_doc(stale))
    # R2: a plain {benchmark: score} JSON in points
    r2 = write_json(
        tmp_path / "r2.json",
        {
            "arc_easy": 70.5,
            "hellaswag": 60.0,
            "gsm8k": 41.0,
            "mmlu": 60.2,
            "truthfulqa_mc2": 45.0,
            "medqa_4options": 33.0,
        },
    )
    # R3: plain JSON in fractions, worse than the fine-tune on the damaged benchmarks
    r3 = write_json(
        tmp_path / "r3.json",
        {
            "arc_easy": 0.63,
            "hellaswag": 0.60,
            "gsm8k": 0.56,
            "mmlu": 0.585,
            "truthfulqa_mc2": 0.45,
            "medqa_4options": 0.52,
        },
    )
    return {"base": base.parent, "ft": ft, "r1": r1_dir, "r2": r2, "r3": r3, "tmp": tmp_path}


def by_name(doc):
    return {c["name"]: c for c in doc["candidates"]}


def test_hand_computed_values_three_candidates(files):
    doc = score_files(
        files["base"],
        files["ft"],
        [f"r1={files['r1']}", str(files["r2"]), str(files["r3"])],
        targets=["medqa_4options"],
    )
    parts = {b["name"]: b["partition"] for b in doc["benchmarks"]}
    assert parts == {
        "arc_easy": "damaged",
        "hellaswag": "unchanged",
        "gsm8k": "improved",
        "mmlu": "damaged",
        "truthfulqa_mc2": "unchanged",
        "medqa_4options": "target",
    }
    # lower-is-better wikitext is skipped; mmlu subtasks are not scored twice
    assert "wikitext" not in parts and "mmlu_stem" not in parts
    margins = {b["name"]: b["margin"] for b in doc["benchmarks"]}
    assert margins["arc_easy"] == pytest.approx(2.6172505, abs=1e-6)
    assert margins["gsm8k"] == pytest.approx(3.8467, abs=1e-4)
    assert margins["mmlu"] == pytest.approx(1.1313708, abs=1e-6)
    assert doc["inputs"]["base"]["metrics"]["arc_easy"] == "acc_norm,none"
    assert doc["inputs"]["base"]["metrics"]["gsm8k"] == "exact_match,strict-match"
    assert doc["inputs"]["base"]["scale"] == "fraction"

    c = by_name(doc)
    r1 = c["r1"]
    # repair: arc (68-65)/(70-65) = 60 %, mmlu (59.5-58.5)/(60-58.5) = 66.667 % -> 63.333 %
    assert r1["repair"] == pytest.approx(63.333333, abs=1e-4)
    # retention: gsm8k (52-40)/(55-40) = 80 %
    assert r1["retention"] == pytest.approx(80.0, abs=1e-9)
    # HM = 2·63.333·80/143.333 = 70.6977
    assert r1["hm"] == pytest.approx(70.697674, abs=1e-4)
    # unchanged: hellaswag -0.5, truthfulqa +1.0 -> +0.25 points
    assert r1["unchanged_mean_change"] == pytest.approx(0.25, abs=1e-9)
    # target: (47-30)/(50-30) = 85 %
    assert r1["target_retention"]["medqa_4options"] == pytest.approx(85.0, abs=1e-9)
    assert r1["target_retention_mean"] == pytest.approx(85.0, abs=1e-9)

    r2 = c["r2"]
    # repair: arc 5.5/5 = 110 %, mmlu 1.7/1.5 = 113.333 % -> 111.667 %; retention 1/15 = 6.667 %
    assert r2["repair"] == pytest.approx(111.666667, abs=1e-4)
    assert r2["retention"] == pytest.approx(6.666667, abs=1e-4)
    assert r2["hm"] == pytest.approx(12.582160, abs=1e-4)
    assert r2["target_retention_mean"] == pytest.approx(15.0, abs=1e-9)

    r3 = c["r3"]
    # repair: arc (63-65)/5 = -40 %, mmlu 0 % -> -20 %; retention (56-40)/15 = 106.667 %
    assert r3["repair"] == pytest.approx(-20.0, abs=1e-9)
    assert r3["retention"] == pytest.approx(106.666667, abs=1e-4)
    assert r3["hm"] == pytest.approx(-20.0, abs=1e-9)  # a side <= 0: the smaller side
    assert doc["inputs"]["candidates"][2]["scale"] == "fraction"

    assert doc["ranking"] == ["r1", "r2", "r3"]
    assert [c["rank"] for c in doc["candidates"]] == [1, 2, 3]


def test_fixed_margin_and_no_stderr_floor(files, tmp_path):
    doc = score_files(files["base"], files["ft"], [str(files["r2"])], margin=3.0)
    parts = {b["name"]: b["partition"] for b in doc["benchmarks"]}
    # with a 3-point margin mmlu (-1.5) is unchanged and medqa (+20, no target) improved
    assert parts["mmlu"] == "unchanged" and parts["medqa_4options"] == "improved"
    assert all(b["margin"] == 3.0 and b["margin_rule"] == "fixed" for b in doc["benchmarks"])
    r2 = doc["candidates"][0]
    # repair: arc only: 110 %; retention: gsm8k 6.667 %, medqa (33-30)/20 = 15 % -> 10.833 %
    assert r2["repair"] == pytest.approx(110.0)
    assert r2["retention"] == pytest.approx(10.833333, abs=1e-5)
    # plain files without stderr: the 0.5-point floor decides
    b = write_json(tmp_path / "b.json", {"x": 50.0, "y": 50.0, "z": 50.0})
    f = write_json(tmp_path / "f.json", {"x": 49.6, "y": 49.4, "z": 51.0})
    doc = score_files(b, f, [str(f)])
    parts = {x["name"]: (x["partition"], x["margin_rule"]) for x in doc["benchmarks"]}
    assert parts == {"x": ("unchanged", "floor"), "y": ("damaged", "floor"), "z": ("improved", "floor")}


def test_stderr_from_one_side_only():
    assert combined_stderr(0.3, 0.4) == pytest.approx(0.5)
    assert combined_stderr(None, 0.4) == pytest.approx(0.4 * math.sqrt(2))
    assert combined_stderr(None, None) is None
    doc = score_candidates(
        {"a": Score(50.0, 1.0)}, {"a": Score(47.0, None)}, {"c": {"a": 48.0}}
    )  # margin 2·√2 = 2.83 -> damaged by 3
    assert doc["benchmarks"][0]["partition"] == "damaged"
    assert doc["benchmarks"][0]["margin"] == pytest.approx(2 * math.sqrt(2))


def test_harmonic_mean_edge_cases():
    assert harmonic_mean(60.0, 80.0) == pytest.approx(2 * 60 * 80 / 140)
    assert harmonic_mean(-10.0, 80.0) == -10.0
    assert harmonic_mean(0.0, 80.0) == 0.0
    assert harmonic_mean(1e-12, 80.0) == pytest.approx(0.0, abs=1e-10)  # continuous at 0
    assert harmonic_mean(None, 80.0) == 80.0
    assert harmonic_mean(55.0, None) == 55.0
    assert harmonic_mean(None, None) is None


def test_no_damaged_and_nothing_to_gate(tmp_path):
    doc = score_candidates({"a": 50.0, "b": 40.0}, {"a": 50.2, "b": 50.0}, {"c": {"a": 50.0, "b": 45.0}})
    c = doc["candidates"][0]
    assert c["repair"] is None and c["retention"] == pytest.approx(50.0) and c["hm"] == pytest.approx(50.0)
    assert any("no damaged benchmarks" in w for w in doc["warnings"])
    doc = score_candidates({"a": 50.0}, {"a": 50.1}, {"c": {"a": 50.0}}, fail_under=0.0)
    assert doc["candidates"][0]["hm"] is None
    assert doc["gate"]["passed"] is False and "undefined" in doc["gate"]["reason"]


def test_metric_option_and_errors(files, tmp_path):
    rf = read_results(files["base"], metric=["acc"])
    assert rf.metrics["arc_easy"] == "acc,none"
    assert rf.metrics["hellaswag"] == "acc,none"
    assert rf.metrics["gsm8k"] == "exact_match,strict-match"  # no acc: the default rule
    assert rf.scores["arc_easy"].value == pytest.approx(73.0)
    assert rf.scores["arc_easy"].stderr == pytest.approx(0.88)
    rf = read_results(files["base"], metric=["gsm8k=exact_match,flexible-extract"])
    assert rf.metrics["gsm8k"] == "exact_match,flexible-extract"
    assert rf.scores["gsm8k"].value == pytest.approx(42.0)
    assert rf.metrics["arc_easy"] == "acc_norm,none"
    rf = read_results(files["base"], metric=["acc_norm"])
    assert rf.metrics["truthfulqa_mc2"] == "acc,none"  # only acc there
    with pytest.raises(InputError, match="'acc_nrom' matches no task"):
        read_results(files["base"], metric=["acc_nrom"])
    with pytest.raises(InputError, match="truthfulqa_mc2.*no metric 'acc_norm'"):
        read_results(files["base"], metric=["truthfulqa_mc2=acc_norm"])
    with pytest.raises(InputError, match="no scored task 'gsm8k_cot'"):
        read_results(files["base"], metric=["gsm8k_cot=exact_match"])
    with pytest.raises(InputError, match="lower-is-better"):
        read_results(files["base"], metric=["wikitext=word_perplexity"])
    with pytest.raises(InputError, match="given twice"):
        MetricRule.parse(["acc", "acc_norm"])
    # the base decides the metric: a fine-tune file without it is an error naming both
    doc = lm_eval_doc(FT)
    del doc["results"]["arc_easy"]["acc_norm,none"]
    ft = write_json(tmp_path / "ft_noacc.json", doc)
    with pytest.raises(InputError, match="arc_easy.*acc_norm,none.*base"):
        score_files(files["base"], ft, [str(files["r2"])])


def test_subtasks_groups_without_aggregate_and_nan(tmp_path):
    doc = lm_eval_doc(BASE)
    rf = read_results(write_json(tmp_path / "a.json", doc), subtasks=True)
    assert "mmlu" not in rf.scores
    assert {"mmlu_formal_logic", "mmlu_abstract_algebra"} <= set(rf.scores)
    # a group without an aggregate score stands aside for its subtasks
    del doc["results"]["mmlu"]["acc,none"], doc["results"]["mmlu"]["acc_stderr,none"]
    rf = read_results(write_json(tmp_path / "b.json", doc))
    assert "mmlu" not in rf.scores and {"mmlu_humanities", "mmlu_stem"} <= set(rf.scores)
    assert rf.scores["mmlu_humanities"].stderr is None  # "N/A"
    doc["results"]["hellaswag"]["acc_norm,none"] = float("nan")
    p = tmp_path / "c.json"
    p.write_text(json.dumps(doc))  # bare NaN, as lm-eval writes it
    with pytest.raises(InputError, match="hellaswag"):
        read_results(p)


def test_scale_rules(tmp_path):
    p = write_json(tmp_path / "pts.json", {"a": 45.0, "b": 0.5})
    # each benchmark its own unit: b is a fraction beside a's points (--units points: 0.5 points)
    assert load_results(p)["b"].value == pytest.approx(50.0) and load_results(p)["a"].value == 45.0
    assert load_results(p, scale="points")["b"].value == 0.5
    assert load_results(write_json(tmp_path / "fr.json", {"a": 0.45}))["a"].value == pytest.approx(45.0)
    assert load_results(tmp_path / "fr.json", scale="points")["a"].value == 0.45
    with pytest.raises(InputError, match="not in \\[0, 1\\]"):
        load_results(p, scale="fraction")
    with pytest.raises(InputError, match="not a number"):
        load_results(write_json(tmp_path / "bad.json", {"a": "high"}))
    nested = write_json(tmp_path / "n.json", {"a": {"score": 0.5, "stderr": 0.01}})
    assert load_results(nested)["a"] == Score(50.0, 1.0)


def test_missing_benchmarks_and_targets_are_input_errors(files, tmp_path):
    short = write_json(tmp_path / "short.json", {"arc_easy": 70.0, "hellaswag": 60.0})
    with pytest.raises(InputError, match="candidate 'short'.*lacks benchmark 'gsm8k'.*and 3 more"):
        score_files(files["base"], files["ft"], [str(short)])
    with pytest.raises(InputError, match="fine-tune results .*lack benchmark"):
        score_files(files["base"], short, [str(files["r2"])])
    with pytest.raises(InputError, match="--target 'nope'"):
        score_files(files["base"], files["ft"], [str(files["r2"])], targets=["nope"])
    with pytest.raises(InputError, match="given twice"):
        score_files(files["base"], files["ft"], [f"x={files['r2']}", f"x={files['r3']}"])
    with pytest.raises(InputError, match="no such file"):
        score_files(files["base"], files["ft"], [str(tmp_path / "missing.json")])


def test_cli_table_json_gate_and_exit_codes(files, tmp_path):
    common = ["score", "--base", files["base"], "--ft", files["ft"], "--target", "medqa_4options"]
    r = run_dghard(
        *common, "--candidate", f"r1={files['r1']}", "--candidate", files["r2"], "--fail-under", "70"
    )
    assert r.returncode == 0, r.stderr
    assert "candidate r1" in r.stdout and "ranking" in r.stdout and "gate: PASS" in r.stdout
    assert "70.7" in r.stdout  # r1's HM in the ranking
    report = tmp_path / "score.json"
    r = run_dghard(
        *common,
        "--candidate",
        f"r1={files['r1']}",
        "--candidate",
        files["r2"],
        "--fail-under",
        "71",
        "--json",
        "--report",
        report,
    )
    assert r.returncode == 1
    doc = json.loads(r.stdout)  # exactly one JSON document, nothing else
    assert doc["gate"]["passed"] is False and doc["gate"]["candidate"] == "r1"
    assert doc["candidates"][0]["hm"] == pytest.approx(70.697674, abs=1e-4)
    assert "below --fail-under 71" in r.stderr and "Traceback" not in r.stderr
    assert json.loads(report.read_text()) == doc
    r = run_dghard(*common, "--candidate", tmp_path / "nope.json")
    assert r.returncode == 2 and "nope.json" in r.stderr and "Traceback" not in r.stderr
