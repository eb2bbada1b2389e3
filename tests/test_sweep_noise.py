"""A sweep that noise cannot fool (sweeping/compare.py, sweeping/choose.py).

1. The standard error of the difference between two candidates' HM, paired item by item where
   the results list their items, against the spread of that difference over many simulated
   evaluations whose models share their items (a real benchmark): it must match it; unpaired
   (stderrs only) it must not be smaller.
2. The choice: on simulated evaluations with known true scores, 8 items a benchmark shared by
   every model, and a family of candidates whose true optimum lies anywhere along its axis,
   the candidate the sweep's rule chooses is closer to the best true HM than the best observed
   score's, and its observed score overstates its true one by less.
3. The rule itself: the tie set, the declared prior, the report's rows and reason, the warning
   about the evaluation's resolution, and ``--tie-rule 0`` (the best observed score)."""

from __future__ import annotations

import json
import math
import shlex
import sys

import numpy as np
import pytest
from test_sweep import Pair

from dghard_cli.errors import InputError
from dghard_cli.scoring.metrics import differences, harmonic_mean, score_candidates
from dghard_cli.scoring.results import Score
from dghard_cli.sweeping.choose import DEFAULT_TIE_RULE, by_prior, choose_winner, incumbent, tie_set
from dghard_cli.sweeping.run import SweepOptions, sweep

#: benchmark -> (partition, true base %, true fine-tune %)
BENCH = {
    "facts": ("damaged", 90.0, 30.0),
    "sums": ("damaged", 85.0, 35.0),
    "code": ("improved", 20.0, 85.0),
    "chat": ("improved", 25.0, 80.0),
}


def _score(u: np.ndarray, p: float, with_items: bool = True) -> Score:
    """One model on the items ``u`` (a latent difficulty each): right where u < p."""
    xs = (u < p / 100.0).astype(float)
    n, m = len(xs), float(xs.mean())
    se = 100.0 * math.sqrt(max(m * (1 - m), 1.0 / n) / (n - 1))
    return Score(100.0 * m, se, tuple(100.0 * xs) if with_items else None)


def _true_acc(k: str, r: float, t: float) -> float:
    """The true accuracy on ``k`` of a model that repairs share ``r`` of the damage and keeps
    share ``t`` of the gain."""
    part, b, f = BENCH[k]
    return f + (b - f) * r if part == "damaged" else b + (f - b) * t


# -- 1. the paired standard error of a difference


def _two_candidates(rng, n: int, with_items: bool):
    us = {k: rng.random(n) for k in BENCH}
    base = {k: _score(us[k], BENCH[k][1], with_items) for k in BENCH}
    ft = {k: _score(us[k], BENCH[k][2], with_items) for k in BENCH}
    c1 = {k: _score(us[k], _true_acc(k, 0.75, 0.70), with_items) for k in BENCH}
    c2 = {k: _score(us[k], _true_acc(k, 0.60, 0.80), with_items) for k in BENCH}
    cands = [("c1", c1), ("c2", c2)]
    doc = score_candidates(base, ft, cands, margin=5.0)
    assert doc["counts"]["damaged"] == 2 and doc["counts"]["improved"] == 2
    d = differences(base, ft, cands, doc, "c2")["c1"]
    return d["diff"], d["diff_stderr"], d["paired"]


def test_the_paired_stderr_of_a_difference_matches_its_spread_and_the_unpaired_one_is_not_smaller():
    rng = np.random.default_rng(7)
    runs = [_two_candidates(rng, 300, True) for _ in range(600)]
    assert all(p for _, _, p in runs)
    spread = float(np.std([d for d, _, _ in runs], ddof=1))
    reported = float(np.mean([se for _, se, _ in runs]))
    assert reported == pytest.approx(spread, rel=0.15), (spread, reported)
    rng = np.random.default_rng(7)
    runs = [_two_candidates(rng, 300, False) for _ in range(600)]
    unpaired = float(np.mean([se for _, se, _ in runs]))
    assert not any(p for _, _, p in runs) and unpaired > 2 * reported  # the shared items cancel


def test_the_difference_with_itself_is_zero_and_an_unknown_stderr_stays_unknown():
    base = {"facts": (80.0, 1.0), "code": (30.0, 1.0)}
    ft = {"facts": (55.0, 1.0), "code": (60.0, 1.0)}
    cands = [("a", {"facts": 70.0, "code": 50.0}), ("b", {"facts": (65.0, 2.0), "code": (55.0, 2.0)})]
    doc = score_candidates(base, ft, cands, margin=5.0)
    d = differences(base, ft, cands, doc, "b")
    assert d["b"] == {"diff": 0.0, "diff_stderr": 0.0, "paired": True}
    by = {c["name"]: c for c in doc["candidates"]}
    assert d["a"]["diff"] == pytest.approx(by["a"]["hm"] - by["b"]["hm"]) and d["a"]["diff_stderr"] is None
    with pytest.raises(ValueError, match="measure"):
        differences(base, ft, cands, doc, "b", measure="HM")


def test_the_difference_stderr_follows_the_definitions_by_hand():
    """One damaged and one improved benchmark, stderrs only: the difference's gradient in each
    score, from R = (c − f)/(b − f)·100, T = (c − b)/(f − b)·100 and HM = 2RT/(R + T)."""
    base = {"facts": (80.0, 1.0), "code": (30.0, 1.5)}
    ft = {"facts": (55.0, 2.0), "code": (60.0, 1.0)}
    a = {"facts": (70.0, 2.5), "code": (50.0, 1.0)}
    b = {"facts": (62.0, 0.5), "code": (57.0, 3.0)}
    cands = [("a", a), ("b", b)]
    doc = score_candidates(base, ft, cands, margin=5.0)

    def hm(c_f, c_c, b_f, b_c, f_f, f_c):
        return harmonic_mean((c_f - f_f) / (b_f - f_f) * 100, (c_c - b_c) / (f_c - b_c) * 100)

    x = [a["facts"][0], a["code"][0], b["facts"][0], b["code"][0], 80.0, 30.0, 55.0, 60.0]
    se = [a["facts"][1], a["code"][1], b["facts"][1], b["code"][1], 1.0, 1.5, 2.0, 1.0]

    def diff(v):
        return hm(v[0], v[1], v[4], v[5], v[6], v[7]) - hm(v[2], v[3], v[4], v[5], v[6], v[7])

    grad = []
    for i in range(len(x)):
        h = 1e-6
        up, dn = list(x), list(x)
        up[i] += h
        dn[i] -= h
        grad.append((diff(up) - diff(dn)) / (2 * h))
    want = math.sqrt(sum((g * s) ** 2 for g, s in zip(grad, se, strict=True)))
    d = differences(base, ft, cands, doc, "b")["a"]
    assert d["diff"] == pytest.approx(diff(x)) and d["diff_stderr"] == pytest.approx(want, rel=1e-6)


# -- 2. the choice on simulated evaluations

ALPHAS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]


def _simulated_sweep(rng, n: int, rule: float) -> tuple[float, float] | None:
    """One evaluation of a family of 10 candidates on n items a benchmark: the chosen one's
    regret (best true HM − its true HM) and optimism (its observed HM − its true HM)."""
    p, q = rng.choice([0.5, 1.0, 2.0, 4.0], size=2)  # where the optimum lies: anywhere

    def truth(a: float) -> tuple[float, float]:
        return 1 - a**p, 1 - (1 - a) ** q  # share repaired, share of the gain kept

    us = {k: rng.random(n) for k in BENCH}
    base = {k: _score(us[k], BENCH[k][1]) for k in BENCH}
    ft = {k: _score(us[k], BENCH[k][2]) for k in BENCH}
    cands = [(f"a={a}", {k: _score(us[k], _true_acc(k, *truth(a))) for k in BENCH}) for a in ALPHAS]
    doc = score_candidates(base, ft, cands, margin=None)
    by = {c["name"]: c for c in doc["candidates"]}
    rows = [
        {
            "name": nm, "status": "ok", "hm": by[nm]["hm"], "feasible": True, "order": i + 1,
            "entry": 0, "distance": 1 - a, "prior": [1],
            "true": harmonic_mean(100 * truth(a)[0], 100 * truth(a)[1]),
        }
        for i, ((nm, _), a) in enumerate(zip(cands, ALPHAS, strict=True))
    ]  # fmt: skip
    best = incumbent(rows)
    if best is None:
        return None
    d = differences(base, ft, cands, doc, best["name"])
    for r in rows:
        r["vs_best_stderr"] = d[r["name"]]["diff_stderr"]
    w, _ = choose_winner(rows, None, 0.0, "hm", rule)
    assert w is not None
    return max(r["true"] for r in rows) - w["true"], w["hm"] - w["true"]


def _outcomes(rule: float, n: int = 8, runs: int = 150) -> tuple[float, float, float]:
    rng = np.random.default_rng(46)
    res = [r for r in (_simulated_sweep(rng, n, rule) for _ in range(runs)) if r is not None]
    regret = np.array([r[0] for r in res])
    return float(regret.mean()), float(regret.max()), float(np.mean([r[1] for r in res]))


def test_the_rule_chooses_closer_to_the_best_true_hm_than_the_best_observed_score():
    best_observed = _outcomes(0.0)
    rule = _outcomes(DEFAULT_TIE_RULE)
    # measured (150 evaluations, seed 46, 8 items): the best observed score: regret mean 7.0,
    # worst 61.9, optimism 12.9; the rule: regret mean 3.6, worst 29.3, optimism 1.6. With 32
    # items: 1.6, 12.3, 2.4 against 1.1, 7.7, -0.2 (docs/sweep.md)
    assert rule[0] < 0.7 * best_observed[0] and rule[0] <= 5.0, (rule, best_observed)
    assert rule[1] < 0.6 * best_observed[1], (rule, best_observed)
    assert rule[2] <= 5.0 and rule[2] < 0.5 * best_observed[2], (rule, best_observed)


# -- 3. the rule, the prior and the report


def _row(name, hm, se, *, entry=0, distance=0.5, order=1, default=False, feasible=True):
    return {
        "name": name, "status": "ok", "hm": hm, "vs_best_stderr": se, "entry": entry, "distance": distance,
        "order": order, "prior": [0 if default else 1], "feasible": feasible,
    }  # fmt: skip


def test_the_tie_set_and_the_declared_prior():
    rows = [
        _row("best", 60.0, 0.0, entry=0, distance=0.2, order=1),
        _row("near-a", 55.0, 3.0, entry=1, distance=0.3, order=2),
        _row("near-b", 54.0, 4.0, entry=1, distance=0.6, order=3),
        _row("near-c", 52.0, 5.0, entry=1, distance=0.9, order=4),
        _row("far", 40.0, 5.0, entry=2, distance=0.5, order=5),
        _row("unknown", 59.0, None, entry=2, distance=0.5, order=6),
    ]
    tied = tie_set(rows, None, 0.0, "hm", 2.0)
    assert [r["name"] for r in tied] == ["best", "near-a", "near-b", "near-c"]  # 'unknown': no noise known
    assert by_prior(tied)["name"] == "near-b"  # entry 1 has most tied members; its middle by distance
    assert tie_set(rows, None, 1.5, "hm", 2.0)[1]["name"] == "unknown"  # within --tie-tolerance
    assert choose_winner(rows, None, 0.0, "hm", 0.0)[0]["name"] == "best"  # --tie-rule 0
    rows.append(_row("default", 50.0, 6.0, entry=3, distance=1.0, order=7, default=True))
    assert choose_winner(rows, None, 0.0, "hm", 2.0)[0]["name"] == "default"  # ties: first by the prior
    rows[-1]["hm"] = 30.0  # no longer within noise of the best
    assert choose_winner(rows, None, 0.0, "hm", 2.0)[0]["name"] == "near-b"
    rows[2]["feasible"] = rows[3]["feasible"] = False  # infeasible candidates never tie
    assert by_prior(tie_set(rows, None, 0.0, "hm", 2.0))["name"] == "best"


NOISY_EVAL = """
import json, subprocess, sys
model, output, evaluate, se = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
rc = subprocess.call([sys.executable, evaluate, model, output])
if rc == 0:
    res = json.load(open(output))
    json.dump({k: {"score": v, "stderr": se} for k, v in res.items()}, open(output, "w"))
sys.exit(rc)
"""


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Pair:
    p = Pair(tmp_path_factory.mktemp("noise"))
    (p.root / "noisy.py").write_text(NOISY_EVAL)
    return p


def _noisy_sweep(pair: Pair, out, se: float, **kw) -> dict:
    q = shlex.quote
    template = f"{q(sys.executable)} {q(str(pair.root / 'noisy.py'))} {{model}} {{output}} {q(str(pair.script))} {se}"
    kw.setdefault("budget", 8)
    opts = SweepOptions(eval_template=template, candidates=pair.candidates, plot=False, **kw)
    return sweep(pair.base, pair.ft, out, opts)


def test_a_sweep_reports_each_difference_from_the_best_and_why_its_winner_won(pair, tmp_path):
    doc = _noisy_sweep(pair, tmp_path / "quiet", 0.5)
    rows = [r for r in doc["candidates"] if r["status"] == "ok"]
    assert all(r["vs_best"] is not None and r["vs_best_stderr"] is not None for r in rows)
    best = max(rows, key=lambda r: (r["hm"], -r["order"]))
    assert best["vs_best"] == 0.0 and all(r["vs_best"] == pytest.approx(r["hm"] - best["hm"]) for r in rows)
    choice = doc["winner"]["choice"]
    assert choice["best"] == best["name"] and doc["winner"]["name"] in choice["tie_set"]
    assert choice["tie_rule"] == DEFAULT_TIE_RULE and doc["options"]["tie_rule"] == DEFAULT_TIE_RULE
    assert doc["resolution"] is not None and not any("resolves about" in w for w in doc["warnings"])

    doc = _noisy_sweep(pair, tmp_path / "noisy", 10.0)  # ±10 points a benchmark: nothing is resolved
    assert any("resolves about" in w and "more items, not more candidates" in w for w in doc["warnings"])
    choice = doc["winner"]["choice"]
    ok = [r for r in doc["candidates"] if r["status"] == "ok" and r["feasible"]]
    assert (
        len(choice["tie_set"]) == len(ok) > 1
        and "tie with it" in choice["reason"]
        or "cannot resolve" in choice["reason"]
    )
    strict = _noisy_sweep(pair, tmp_path / "strict", 10.0, tie_rule=0.0)  # the best observed score
    assert strict["winner"]["name"] == max(ok, key=lambda r: (r["hm"], -r["order"]))["name"]


@pytest.mark.parametrize("bad", [-1.0, math.nan, 11.0])
def test_a_tie_rule_outside_its_range_is_refused(pair, tmp_path, bad):
    with pytest.raises(InputError, match="--tie-rule"):
        _noisy_sweep(pair, tmp_path / "x", 1.0, tie_rule=bad)
    assert not (tmp_path / "x").exists()


def test_the_report_is_plain_json(pair, tmp_path):
    doc = _noisy_sweep(pair, tmp_path / "out", 2.0)
    assert (
        json.loads((tmp_path / "out" / "sweep_report.json").read_text())["winner"]["choice"]
        == doc["winner"]["choice"]
    )


SPLIT_EVAL = """
import json, os, subprocess, sys, time
model, output, evaluate, split, log = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
rc = subprocess.call([sys.executable, evaluate, model, output])
with open(log, "a") as fh:
    fh.write(json.dumps({"split": split, "name": os.environ["DGHARD_CANDIDATE"], "t": time.time()}) + "\\n")
if rc == 0:
    res = json.load(open(output))
    shift = {"val": 0.0, "test": -3.0}[split]  # the held-out split scores every model lower
    json.dump({k: {"score": v + shift * (k != "chat"), "stderr": 1.0} for k, v in res.items()}, open(output, "w"))
sys.exit(rc)
"""


def _split_sweep(pair: Pair, out, log, *, split: bool = True, **kw) -> dict:
    q = shlex.quote
    (pair.root / "split.py").write_text(SPLIT_EVAL)
    arg = "{split}" if split else "val"
    template = (
        f"{q(sys.executable)} {q(str(pair.root / 'split.py'))} {{model}} {{output}} {q(str(pair.script))} "
        f"{arg} {q(str(log))}"
    )
    opts = SweepOptions(eval_template=template, budget=8, candidates=pair.candidates, plot=False, **kw)
    return sweep(pair.base, pair.ft, out, opts)


def test_the_held_out_split_is_evaluated_once_after_the_choice_and_never_changes_it(pair, tmp_path):
    log = tmp_path / "log.jsonl"
    doc = _split_sweep(pair, tmp_path / "out", log)
    runs = [json.loads(x) for x in log.read_text().splitlines()]
    val, test = [r for r in runs if r["split"] == "val"], [r for r in runs if r["split"] == "test"]
    assert len(val) == 8 and len(test) == 3  # BASE, FT and the winner, once
    assert max(r["t"] for r in val) < min(r["t"] for r in test)  # never read before the choice
    assert sorted(r["name"] for r in test) == sorted(
        ["BASE (test)", "FT1 (test)", f"{doc['winner']['name']} (test)"]
    )
    h = doc["holdout"]
    assert h["status"] == "ok" and h["split"] == "test" and h["chosen_on"] == "val"
    assert h["validation"]["hm"] == doc["winner"]["hm"]
    assert h["optimism"] == pytest.approx(h["validation"]["hm"] - h["winner"]["hm"])
    assert h["winner"]["hm_stderr"] > 0 and h["optimism_stderr"] > 0
    assert doc["budget"]["held_out_evaluations"] == 3 and doc["budget"]["used"] == 8
    # the same sweep without {split} (every evaluation is the val one): the same rows and winner
    plain = _split_sweep(pair, tmp_path / "plain", tmp_path / "log2.jsonl", split=False)
    assert plain["holdout"] is None and plain["winner"]["name"] == doc["winner"]["name"]
    assert [r["hm"] for r in plain["candidates"]] == [r["hm"] for r in doc["candidates"]]


def test_an_interrupted_held_out_evaluation_resumes_from_the_cache(pair, tmp_path, monkeypatch):
    from dghard_cli.errors import Interrupted
    from dghard_cli.sweeping import holdout

    log, out = tmp_path / "log.jsonl", tmp_path / "out"
    real = holdout.run_jobs

    def interrupt_after(s, jobs, on_done):
        real(s, jobs, on_done)
        if jobs and "(test)" in jobs[0].label:
            raise KeyboardInterrupt

    monkeypatch.setattr(holdout, "run_jobs", interrupt_after)
    with pytest.raises(Interrupted):
        _split_sweep(pair, out, log)
    assert not out.exists()
    monkeypatch.setattr(holdout, "run_jobs", real)
    log.unlink()
    doc = _split_sweep(pair, out, log)
    assert not log.exists()  # every evaluation, the held-out ones too, came from the cache
    assert doc["holdout"]["status"] == "ok" and doc["holdout"]["from_cache"] == 3
    assert holdout.for_split("x {split} {model}", "test") == "x test {model}"


def test_refinement_steps_inside_the_noise_are_not_taken_and_the_unspent_budget_is_said(pair, tmp_path):
    noisy = _noisy_sweep(pair, tmp_path / "noisy", 10.0, budget=14)
    plain = _noisy_sweep(pair, tmp_path / "plain", 10.0, budget=14, tie_rule=0.0)
    assert plain["budget"]["refinements_inside_noise"] == 0
    assert noisy["budget"]["refinements_inside_noise"] >= 1
    # the budget the tied steps would have taken goes to steps that can still be resolved (other
    # families' refinement) instead of one family's flat stretch
    refined = {r["entry"] for r in noisy["candidates"] if r["phase"] == "refine"}
    assert len(refined) > len({r["entry"] for r in plain["candidates"] if r["phase"] == "refine"})
    if noisy["budget"]["used"] < 14:
        assert any("left unspent" in n for n in noisy.get("notes", []))


# -- found by review


def test_tie_rule_0_is_the_earlier_rule_exactly():
    rows = [
        _row("near", 80.0, 1.0, entry=0, distance=0.1, order=1),
        _row("far", 80.0, 1.0, entry=0, distance=0.3, order=2),
    ]
    assert choose_winner(rows, None, 0.0, "hm", 0.0)[0]["name"] == "near"  # closest to FT, as before
    assert choose_winner(rows, None, 0.0, "hm", 2.0)[0]["name"] == "far"  # the prior's middle of two


def test_two_candidates_with_items_are_paired_when_base_and_ft_give_stderrs_only():
    rng = np.random.default_rng(3)
    us = {k: rng.random(200) for k in BENCH}
    base = {k: Score(_score(us[k], BENCH[k][1]).value, 2.0) for k in BENCH}
    ft = {k: Score(_score(us[k], BENCH[k][2]).value, 2.0) for k in BENCH}
    c1 = {k: _score(us[k], _true_acc(k, 0.75, 0.70)) for k in BENCH}
    c2 = {k: _score(us[k], _true_acc(k, 0.70, 0.75)) for k in BENCH}
    cands = [("c1", c1), ("c2", c2)]
    doc = score_candidates(base, ft, cands, margin=5.0)
    paired = differences(base, ft, cands, doc, "c2")["c1"]
    strip = [(n, {k: Score(v.value, v.stderr) for k, v in c.items()}) for n, c in cands]
    unpaired = differences(base, ft, strip, score_candidates(base, ft, strip, margin=5.0), "c2")["c1"]
    assert paired["paired"] and not unpaired["paired"]
    assert paired["diff_stderr"] < 0.5 * unpaired["diff_stderr"]


def test_a_failed_job_waited_on_again_gives_the_same_result():
    from dghard_cli.sweeping.executors import LocalExecutor

    def fn(job, assignment):
        raise OSError("the worker lost its scratch disk")

    errors: list = []

    def on_error(job, exc):
        errors.append(job)
        return ("failed", job, str(exc))

    ex = LocalExecutor(fn, 1, on_error)
    h = ex.submit("job-a", {})
    first = ex.wait([h], timeout=10)
    again = ex.wait([h], timeout=10)  # the sweep handles a job once more after an interruption
    ex.close()
    assert first == again == [(h, ("failed", "job-a", "the worker lost its scratch disk"))]
    assert errors == ["job-a"]


def test_a_command_that_answers_the_interruption_with_exit_0_and_no_results_is_not_cached(tmp_path):
    import threading
    import time

    from dghard_cli.sweeping import evaluate
    from dghard_cli.sweeping.jobs import Job, run_job

    started = tmp_path / "started"
    template = f"trap 'echo partial > {{output}}; exit 0' TERM; touch {started}; sleep 30 & wait # {{model}}"
    job = Job(key="k", label="x", template=template, timeout=None, workdir=str(tmp_path / "w"), base="b",
              device="cpu", model=str(tmp_path))  # fmt: skip
    out: list = []
    evaluate.allow_evaluations()
    t = threading.Thread(target=lambda: out.append(run_job(job)))
    t.start()
    while not started.exists():
        time.sleep(0.02)
    evaluate.terminate_running(wait=evaluate.KILL_GRACE_S + 2)
    t.join(timeout=30)
    evaluate.allow_evaluations()
    assert out and out[0].cacheable is False and out[0].rec["status"] == "failed"
    assert "interrupted" in out[0].rec["message"]


def test_a_held_out_evaluation_that_writes_into_the_winner_is_reported_and_the_winner_written_again(
    pair, tmp_path, monkeypatch
):
    q = shlex.quote
    evil = SPLIT_EVAL.replace(
        "rc = subprocess.call(",
        "if split == 'test' and 'BASE' not in os.environ['DGHARD_CANDIDATE'] and 'FT' not in "
        "os.environ['DGHARD_CANDIDATE']:\n    open(os.path.join(model, 'planted.txt'), 'w').write('x')\n"
        "rc = subprocess.call(",
    )
    (pair.root / "evil.py").write_text(evil)
    log = tmp_path / "log.jsonl"
    template = (
        f"{q(sys.executable)} {q(str(pair.root / 'evil.py'))} {{model}} {{output}} {q(str(pair.script))} "
        f"{{split}} {q(str(log))}"
    )
    out = tmp_path / "out"
    doc = sweep(
        pair.base,
        pair.ft,
        out,
        SweepOptions(eval_template=template, budget=8, candidates=pair.candidates, plot=False),
    )
    assert doc["holdout"]["status"] == "failed" and "written again" in doc["holdout"]["message"]
    assert any("no held-out estimate" in w for w in doc["warnings"])
    assert out.is_dir() and not (out / "planted.txt").exists() and doc["winner"] is not None
