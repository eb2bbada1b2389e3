"""``score --units auto`` decides each benchmark's unit: fractions, points, unbounded (−NLL)."""

from __future__ import annotations

import json

import pytest
from conftest import run_dghard

from dghard_cli.scoring.run import score_files

# accuracies as fractions next to a −NLL, as a hand-written {benchmark: score} file has them
BASE = {"arc": 0.700, "mmlu": 0.600, "hellaswag": 0.550, "wiki_neg_nll": -2.00}
FT = {"arc": 0.660, "mmlu": 0.597, "hellaswag": 0.620, "wiki_neg_nll": -2.20}
CAND = {"arc": 0.690, "mmlu": 0.599, "hellaswag": 0.600, "wiki_neg_nll": -2.05}


def _write(tmp_path, **docs):
    out = {}
    for name, doc in docs.items():
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(doc))
        out[name] = p
    return out


def reference(base, ft, cand, units, min_margin=0.5):
    """Partitions and HM in float64 from the definitions, each benchmark in its own unit."""
    parts, rep, ret, unch = {}, [], [], []
    for k in base:
        scale = 100.0 if units[k] == "fraction" else 1.0
        b, f, c = base[k] * scale, ft[k] * scale, cand[k] * scale
        m = min_margin if units[k] != "unbounded" else min_margin / 100 * max(abs(b), abs(f))
        if f < b - m:
            parts[k] = "damaged"
            rep.append((c - f) / (b - f) * 100)
        elif f > b + m:
            parts[k] = "improved"
            ret.append((c - b) / (f - b) * 100)
        else:
            parts[k] = "unchanged"
            if units[k] != "unbounded":
                unch.append(c - b)
    r, t = sum(rep) / len(rep), sum(ret) / len(ret)
    hm = 2 * r * t / (r + t) if r > 0 and t > 0 else min(r, t)
    return parts, r, t, hm, (sum(unch) / len(unch) if unch else None)


def test_fractions_beside_a_negative_nll_are_fractions_and_the_nll_keeps_its_units(tmp_path):
    p = _write(tmp_path, base=BASE, ft=FT, cand=CAND)
    doc = score_files(p["base"], p["ft"], [str(p["cand"])])
    units = {"arc": "fraction", "mmlu": "fraction", "hellaswag": "fraction", "wiki_neg_nll": "unbounded"}
    parts, r, t, hm, unch = reference(BASE, FT, CAND, units)
    assert {b["name"]: b["unit"] for b in doc["benchmarks"]} == units
    assert {b["name"]: b["partition"] for b in doc["benchmarks"]} == parts
    # arc lost 4 points and the NLL got 10 % worse: both damaged (read as "points", both were
    # within the 0.5 floor and HM came from hellaswag's +0.07 "points" alone)
    assert parts == {
        "arc": "damaged",
        "mmlu": "unchanged",
        "hellaswag": "improved",
        "wiki_neg_nll": "damaged",
    }
    margins = {b["name"]: b["margin"] for b in doc["benchmarks"]}
    assert margins["arc"] == 0.5 and margins["wiki_neg_nll"] == pytest.approx(0.011, abs=1e-12)
    (c,) = doc["candidates"]
    assert c["repair"] == pytest.approx(r, abs=1e-9) and c["retention"] == pytest.approx(t, abs=1e-9)
    assert c["hm"] == pytest.approx(hm, abs=1e-9) and c["unchanged_mean_change"] == pytest.approx(unch)
    # what was assumed: one entry per unit, with the margin floor
    groups = {g["unit"]: g for g in doc["units_assumed"]}
    assert groups["fraction"]["benchmarks"] == ["arc", "mmlu", "hellaswag"]
    assert groups["unbounded"]["benchmarks"] == ["wiki_neg_nll"]
    assert "0.5 % of the larger of |base| and |ft|" in groups["unbounded"]["assumed"]
    assert doc["inputs"]["base"]["scale"] == "mixed"
    assert doc["inputs"]["base"]["units"]["wiki_neg_nll"] == "unbounded"


def test_the_assumed_units_are_printed_one_line_per_group(tmp_path):
    p = _write(tmp_path, base=BASE, ft=FT, cand=CAND)
    r = run_dghard("score", "--base", p["base"], "--ft", p["ft"], "--candidate", p["cand"])
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("units: ")]
    assert len(lines) == 2, r.stdout
    assert lines[0].startswith("units: fraction: arc, mmlu, hellaswag (values in [0, 1]")
    assert lines[1].startswith("units: unbounded: wiki_neg_nll (values below 0 or above 100")


def test_a_points_benchmark_below_1_in_one_file_stays_points(tmp_path):
    # g is 1.4 points in the base, 0.8 in the fine-tune: both files hold points, so 0.8 is points
    p = _write(tmp_path, base={"a": 45.0, "g": 1.4}, ft={"a": 40.0, "g": 0.8}, cand={"a": 44.0, "g": 1.2})
    doc = score_files(p["base"], p["ft"], [str(p["cand"])])
    bm = {b["name"]: b for b in doc["benchmarks"]}
    assert bm["g"]["unit"] == "points" and bm["g"]["ft"] == pytest.approx(0.8)
    assert bm["g"]["partition"] == "damaged"  # −0.6 points, not +78.6
    # a score above 100 in one file makes the benchmark unbounded in all of them
    p = _write(
        tmp_path, base={"a": 45.0, "t": 95.0}, ft={"a": 40.0, "t": 130.0}, cand={"a": 44.0, "t": 120.0}
    )
    doc = score_files(p["base"], p["ft"], [str(p["cand"])])
    bm = {b["name"]: b for b in doc["benchmarks"]}
    assert bm["t"]["unit"] == "unbounded" and bm["t"]["margin"] == pytest.approx(0.65)
    # files in different units (a fraction file and a points file) still work as before
    p = _write(tmp_path, base={"a": 0.5, "b": 0.6}, ft={"a": 0.4, "b": 0.7}, cand={"a": 45.0, "b": 65.0})
    doc = score_files(p["base"], p["ft"], [str(p["cand"])])
    assert doc["candidates"][0]["repair"] == pytest.approx(50.0) and doc["candidates"][0]["retention"] == 50.0
    assert any("different units in different files" in w for w in doc["warnings"])


def test_undefined_hm_is_one_warning_not_two_contradicting_ones(tmp_path):
    p = _write(tmp_path, base={"a": 50.0, "b": 60.0}, ft={"a": 50.2, "b": 59.9}, cand={"a": 50.0, "b": 60.0})
    doc = score_files(p["base"], p["ft"], [str(p["cand"])])
    hm_lines = [w for w in doc["warnings"] if "HM" in w]
    assert hm_lines == [
        "no damaged and no improved benchmarks (outside the targets, the fine-tune moved none by "
        "more than its margin): % repair, % retention and HM are undefined"
    ]
    assert doc["candidates"][0]["hm"] is None


def test_warnings_for_mixed_files_and_lower_is_better_names(tmp_path):
    p = _write(
        tmp_path,
        base={"acc": 0.6, "bleu": 25.0, "wikitext_ppl": 12.0},
        ft={"acc": 0.5, "bleu": 27.0, "wikitext_ppl": 11.0},
        cand={"acc": 0.55, "bleu": 26.0, "wikitext_ppl": 11.5},
    )
    doc = score_files(p["base"], p["ft"], [str(p["cand"])])
    assert {b["name"]: b["unit"] for b in doc["benchmarks"]} == {
        "acc": "fraction",
        "bleu": "points",
        "wikitext_ppl": "points",
    }
    assert any("mixes scores in [0, 1] with points: acc read as fractions" in w for w in doc["warnings"])
    assert any(
        w.startswith("wikitext_ppl: the name looks like a lower-is-better score") for w in doc["warnings"]
    )
