"""The multi-task merge benchmark: its skills, its normalised accuracy, a tiny build, eval and two rows."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO

from dghard_cli.scoring.results import load_results


def _bench():
    name = "merge_bench"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_new_skills_answers() -> None:
    mb = _bench()
    rng = random.Random(5)
    for _ in range(50):
        p, a = mb.make_example("atbash", rng)
        s = p[2:-1]
        assert p.startswith("1:") and [ord(x) + ord(y) for x, y in zip(s, a, strict=True)] == [
            ord("a") + ord("z")
        ] * len(s)
        p, a = mb.make_example("rotate", rng)
        s = p[2:-1]
        assert p.startswith("2:") and a == s[1:] + s[:1] and sorted(a) == sorted(s)
        p, a = mb.make_example("swap", rng)
        s = p[2:-1]
        assert p.startswith("3:") and len(a) == len(s)
        assert all(a[i] == s[i ^ 1] for i in range(len(s) - len(s) % 2))
        if len(s) % 2:
            assert a[-1] == s[-1]
    for t in mb.TASKS:  # --base-sees-tags: the task's prompts, answered by copying the letters
        p, a = mb.make_example(t + mb.FORMAT, random.Random(1))
        assert p == mb.make_example(t, random.Random(1))[0] and a == p[2:-1]
    sets = mb.eval_sets()
    assert list(sets) == [*mb.OLD_SKILLS, *mb.TASKS]
    assert all(len(v) == mb.EVAL_N and len({p for p, _ in v}) == mb.EVAL_N for v in sets.values())
    fsets = mb.fb.eval_sets()
    assert all(sets[s] == fsets[s] for s in (*mb.OLD_SKILLS, "caesar"))  # forgetting_bench's
    held = {p for v in sets.values() for p, _ in v}
    assert not held & {p for p, _ in mb.Sampler(mb.TASKS, 0).batch(2000)}


def test_normalised_accuracy_matches_a_float64_reference() -> None:
    mb = _bench()
    merged = {"a": {"score": 45.0, "stderr": 3.5}, "b": {"score": 0.0, "stderr": 0.5}, "c": {"score": 99.0}}
    merged["c"]["stderr"] = 0.7
    experts = {"a": {"score": 90.0, "stderr": 2.1}, "b": {"score": 100.0, "stderr": 0.5}}
    experts["c"] = {"score": 99.0, "stderr": 0.7}
    m = np.array([45.0, 0.0, 99.0], dtype=np.float64)
    sm = np.array([3.5, 0.5, 0.7])
    e = np.array([90.0, 100.0, 99.0])
    se = np.array([2.1, 0.5, 0.7])
    r = m / e
    se_r = np.sqrt((sm / e) ** 2 + (r * se / e) ** 2)
    na, na_se = mb.normalised_accuracy(merged, experts)
    assert na == pytest.approx(100 * r.mean(), rel=1e-12)
    assert na_se == pytest.approx(100 * np.sqrt((se_r**2).sum()) / 3, rel=1e-12)
    assert na == pytest.approx(100 * (0.5 + 0 + 1) / 3)
    with pytest.raises(ValueError, match="'b'"):
        mb.normalised_accuracy(merged, {**experts, "b": {"score": 0.0, "stderr": 0.5}})
    mean, mean_se = mb.mean_score(merged, ["a", "c"])
    assert mean == 72.0 and mean_se == pytest.approx(math.hypot(3.5, 0.7) / 2)


def test_tiny_build_eval_and_two_table_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mb = _bench()
    work = tmp_path / "w"
    assert mb.main(["build", str(work), "--tiny", "--seed", "3"]) == 0
    first = {t: (mb.expert_dir(work, t) / "model.safetensors").read_bytes() for t in mb.TASKS}
    assert len(set(first.values())) == len(mb.TASKS)  # one expert per skill, all different
    assert mb.main(["build", str(work), "--tiny", "--seed", "3"]) == 0  # reuses BASE, same experts
    assert "base: reusing" in capsys.readouterr().out
    assert first == {t: (mb.expert_dir(work, t) / "model.safetensors").read_bytes() for t in mb.TASKS}
    other = tmp_path / "o"
    assert mb.main(["build", str(other), "--tiny", "--seed", "3", "--base-from", str(work / "base")]) == 0
    assert first == {t: (mb.expert_dir(other, t) / "model.safetensors").read_bytes() for t in mb.TASKS}
    tags = tmp_path / "t"
    assert (
        mb.main(
            [
                "build",
                str(tags),
                "--tiny",
                "--seed",
                "3",
                "--base-from",
                str(work / "base"),
                "--base-sees-tags",
            ]
        )
        == 0
    )
    tagged = (tags / "base" / "model.safetensors").read_bytes()
    assert tagged != (work / "base" / "model.safetensors").read_bytes()
    with pytest.raises(SystemExit, match="other settings"):
        mb.main(["build", str(tags), "--tiny", "--seed", "3"])  # a plain base was asked for
    with pytest.raises(SystemExit, match="other settings"):
        mb.main(["build", str(work), "--tiny", "--seed", "4"])

    out = tmp_path / "e.json"
    assert mb.main(["eval", str(mb.expert_dir(work, "swap")), str(out)]) == 0
    doc = json.loads(out.read_text())
    assert list(doc) == sorted([*mb.OLD_SKILLS, *mb.TASKS])
    assert all(0 <= v["score"] <= 100 and v["stderr"] > 0 for v in doc.values())
    assert set(load_results(out)) == set(doc)  # what dghard score and sweep read
    assert doc == json.loads((work / "expert-swap.json").read_text())  # build's own evaluation

    capsys.readouterr()
    assert mb.main(["table", str(work), "--quick", "--budgets", ""]) == 0
    text = capsys.readouterr().out
    rows = [ln for ln in text.splitlines() if ln.startswith("| ")]
    names = [ln.split(" | ")[0][2:] for ln in rows[1:]]
    assert names == ["BASE", *(f"expert {t} alone" for t in mb.TASKS), "task-arithmetic", "ties"]
    assert not (work / "bench" / "candidate").exists()  # each candidate deleted after its evaluation
    ta = json.loads((work / "bench" / "results" / "task-arithmetic-1.0.json").read_text())
    assert set(ta) == set(doc)


def test_full_candidate_grid_covers_every_method(tmp_path: Path) -> None:
    mb = _bench()
    methods = mb.merge_methods()
    assert {"task-arithmetic", "ties", "dare-linear", "dare-ties", "breadcrumbs", "della"} <= methods
    cands = mb.candidates(methods, tmp_path / "calib.txt")
    fams = {c.family for c in cands}
    plain = {"task-arithmetic", "ties", "dare-linear", "dare-ties", "breadcrumbs", "della"}
    plain |= {"model-stock", "recall", "dg-hard"} | (set(mb.SPECTRAL) & methods)
    plain |= {"star", "cart", "wudi"} & methods
    post = {f for f, _, argv in mb.NEW_2026 if "+" in f and argv[1] in methods}
    assert post == {"task-arithmetic + svc", "iso-c + svc"}
    assert fams == plain | post | {f"{f} + --lines" for f in plain}
    assert len({c.name for c in cands}) == len(cands)
    assert all(c.argv[0] == "--method" for c in cands)


def test_a_refused_merge_is_reported_not_fatal(tmp_path: Path) -> None:
    mb = _bench()
    work = tmp_path / "w"
    assert mb.main(["build", str(work), "--tiny"]) == 0
    bench = mb.Bench(work)
    bench.results.mkdir(parents=True)
    got = bench.run_candidate(
        mb.Candidate("bad", "ties", "density 7", ["--method", "ties", "--density", "7"])
    )
    assert isinstance(got, str) and got.startswith("exit 2: ") and "density" in got
    assert not bench.cand.exists()


def test_facts_scenario_sets_and_a_tiny_build_eval_and_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mb = _bench()
    facts = mb.fact_sets()
    assert list(facts) == [mb.FACT_POOL, *mb.FACT_TASKS]
    keys = [p for v in facts.values() for p, _ in v]
    assert len(keys) == len(set(keys)) == mb.EVAL_N * (1 + len(mb.FACT_TASKS))  # every key distinct
    for v in facts.values():
        for p, a in v:
            assert p.startswith("K:|") and p.endswith(">") and len(p) == 4 + mb.FACT_KEY_LEN
            assert len(a) == mb.FACT_VALUE_LEN and a.isdigit()
    sets = mb.eval_sets(mb.FACT_TASKS)
    assert list(sets) == [*mb.OLD_SKILLS, *mb.FACT_TASKS]
    assert all(sets[t] == list(facts[t]) for t in mb.FACT_TASKS)  # scored on the facts taught
    assert mb.make_example("facts2", random.Random(0)) in facts["facts2"]

    work = tmp_path / "w"
    assert mb.main(["build", str(work), "--tiny", "--seed", "3", "--scenario", "facts"]) == 0
    assert mb.read_scenario(work).tasks == mb.FACT_TASKS
    assert all((mb.expert_dir(work, t) / "model.safetensors").is_file() for t in mb.FACT_TASKS)
    plain = tmp_path / "p"
    assert mb.main(["build", str(plain), "--tiny", "--seed", "3"]) == 0
    assert mb.read_scenario(plain).tasks == mb.TASKS
    with pytest.raises(SystemExit, match="other settings"):  # the facts base is not the plain one
        mb.main(["build", str(plain), "--tiny", "--seed", "3", "--scenario", "facts"])
    other = tmp_path / "o"
    argv = ["build", str(other), "--tiny", "--seed", "3", "--scenario", "facts"]
    assert mb.main([*argv, "--base-from", str(plain / "base")]) == 0
    assert (other / "base" / "model.safetensors").read_bytes() == (
        work / "base" / "model.safetensors"
    ).read_bytes()

    out = tmp_path / "e.json"
    assert mb.main(["eval", "--scenario", "facts", str(mb.expert_dir(work, "facts1")), str(out)]) == 0
    doc = json.loads(out.read_text())
    assert list(doc) == sorted([*mb.OLD_SKILLS, *mb.FACT_TASKS])
    assert doc == json.loads((work / "expert-facts1.json").read_text())
    assert set(load_results(out)) == set(doc)
    assert "--scenario facts" in mb.Bench(work).eval_template()

    capsys.readouterr()
    assert mb.main(["table", str(work), "--quick", "--budgets", ""]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ")]
    assert [ln.split(" | ")[0][2:] for ln in rows[1:]] == [
        "BASE",
        *(f"expert {t} alone" for t in mb.FACT_TASKS),
        "task-arithmetic",
        "ties",
    ]
    assert rows[0].split(" | ")[3:7] == list(mb.FACT_TASKS)


def test_paired_difference_matches_numpy_and_is_tighter_for_correlated_merges() -> None:
    """The lead of merge A over merge B on the same prompts: the mean over tasks of the per-task
    difference of exact-match means divided by the expert's own accuracy, with the stderr of
    the paired differences (numpy, ddof=1) and the expert's own stderr propagated."""
    mb = _bench()
    rng = np.random.default_rng(0)
    tasks = ["t1", "t2", "t3", "t4"]
    experts = {
        t: {"score": s, "stderr": se}
        for t, s, se in zip(tasks, (100, 90, 80, 100), (0.5, 2.1, 2.8, 0.5), strict=True)
    }
    common = {t: rng.random(200) < 0.1 for t in tasks}  # prompts both merges get right
    a = {t: (common[t] | (rng.random(200) < 0.04)).astype(int).tolist() for t in tasks}
    b = {t: (common[t] & (rng.random(200) < 0.9)).astype(int).tolist() for t in tasks}
    d, se = mb.paired_difference(a, b, experts)
    terms, var = [], 0.0
    for t in tasks:
        e, ese = experts[t]["score"] / 100, experts[t]["stderr"] / 100
        diff = np.asarray(a[t], float) - np.asarray(b[t], float)
        r = diff.mean() / e
        terms.append(r)
        var += diff.var(ddof=1) / diff.size / e**2 + (r * ese / e) ** 2
    assert math.isclose(d, 100 * np.mean(terms), rel_tol=1e-12)
    assert math.isclose(se, 100 * math.sqrt(var) / len(tasks), rel_tol=1e-12)
    # the unpaired stderr of the same difference (each row's binomial stderr combined) is larger
    res = {
        name: {
            t: {"score": 100 * np.mean(o[t]), "stderr": 100 * math.sqrt(max(np.var(o[t]), 1 / 200) / 200)}
            for t in tasks
        }
        for name, o in (("a", a), ("b", b))
    }
    na, sa = mb.normalised_accuracy(res["a"], experts)
    nb, sb = mb.normalised_accuracy(res["b"], experts)
    assert math.isclose(na - nb, d, abs_tol=1e-9) and se < math.hypot(sa, sb)
    assert mb.paired_difference(a, a, experts) == (0.0, 0.0)
