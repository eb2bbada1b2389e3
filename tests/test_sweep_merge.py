"""`dghard sweep` with several fine-tunes (--merge-ft): merges as first-class candidates.

Three experts of one small base (``make_pair`` with the same ``seed`` and different
``delta_seed``s), each carrying its own planted task signal plus i.i.d. noise. A stand-in
evaluation scores a checkpoint from its weights: one *domain* benchmark per expert, which rises
with the share of that expert's signal the model carries and falls with the other experts'
signals (interference: no merge keeps 90 % of every expert's gain), and two *skills* of the base
(general, math) that the noise outside every signal's column space damages. Scores are
recomputed here in float64 numpy, and the multi-expert scoring from its definitions.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import f64, load_dir

from dghard_cli.scoring.experts import expert_reference
from dghard_cli.scoring.metrics import score_candidates
from dghard_cli.scoring.results import Score
from dghard_cli.sweeping.run import SweepOptions, sweep
from dghard_cli.testing.synthetic import ArchConfig, DeltaModel, decoder_tensors, make_pair, signal_and_noise

CFG = ArchConfig(
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    vocab_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
)
DM = DeltaModel(strengths=[5.0, 2.5, 1.3, 1.05], noise=2e-3)
SEED = 7
DELTA_SEEDS = (11, 12, 13)
TARGETS = ["domain0", "domain1", "domain2"]

FORMULA = """
def benchmarks(deltas, sig, q0, k):
    num, den, q = [0.0] * k, [0.0] * k, 0.0
    for name, d in deltas.items():
        for i in range(k):
            s = sig[f"S{i}:" + name]
            num[i] += float(np.sum(d * s))
            den[i] += float(np.sum(s * s))
        u = sig["Q:" + name]
        q += float(np.sum((d - u @ (u.T @ d)) ** 2))
    p, q = [a / b for a, b in zip(num, den)], q / q0
    out = {}
    for i in range(k):
        others = sum(p[j] ** 2 for j in range(k) if j != i)
        out[f"domain{i}"] = 40 + 40 * (2 * p[i] - p[i] ** 2) - 30 * others
    out["general"] = max(0.0, 70 - 30 * q)
    out["math"] = max(0.0, 60 - 20 * q ** 0.5)
    return out
"""

EVAL_SCRIPT = (
    """
import json, sys
from pathlib import Path
import numpy as np
from safetensors.numpy import load_file

ROOT = Path(__file__).parent
model, output = sys.argv[1], sys.argv[2]

def load(d):
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out
"""
    + FORMULA
    + """
sig = np.load(ROOT / "signal.npz")
b, m = load(ROOT / "base"), load(model)
names = [k[2:] for k in sig.files if k.startswith("Q:")]
deltas = {n: m[n].astype(np.float64) - b[n].astype(np.float64) for n in names}
Path(output).write_text(json.dumps(benchmarks(deltas, sig, float(sig["q0"]), int(sig["k"]))))
"""
)


class Experts:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.fts = []
        for ds in DELTA_SEEDS:
            base, ft = make_pair(
                root / f"e{ds}", CFG, dtype="float32", ft_shards=1, seed=SEED, delta=DM, delta_seed=ds
            )
            self.fts.append(ft)
        self.base = root / "base"
        base.rename(self.base)  # the same base every time (same seed): keep one
        b = load_dir(self.base)
        self.names = [n for n, shape in decoder_tensors(CFG) if len(shape) == 2]
        arrays: dict = {"k": len(DELTA_SEEDS)}
        for n in self.names:
            us = []
            for i, ds in enumerate(DELTA_SEEDS):
                s, _ = signal_and_noise(n, tuple(b[n].shape), ds, DM)
                arrays[f"S{i}:{n}"] = s.numpy()
                us.append(np.linalg.svd(s.numpy(), full_matrices=False)[0][:, : DM.rank])
            arrays["Q:" + n] = np.linalg.qr(np.hstack(us))[0]
        self.b = {n: f64(b[n]) for n in self.names}
        self.deltas = []
        for ft in self.fts:
            f = load_dir(ft)
            self.deltas.append({n: f64(f[n]) - self.b[n] for n in self.names})
        sig = dict(arrays)
        q0 = 0.0
        for n in self.names:
            d, u = self.deltas[0][n], arrays["Q:" + n]
            q0 += float(np.sum((d - u @ (u.T @ d)) ** 2))
        np.savez(root / "signal.npz", q0=q0, **arrays)
        self.sig, self.q0 = sig, q0
        self.script = root / "evaluate.py"
        self.script.write_text(EVAL_SCRIPT)
        self.template = f"{shlex.quote(sys.executable)} {shlex.quote(str(self.script))} {{model}} {{output}}"
        ns: dict = {"np": np}
        exec(FORMULA, ns)
        self.benchmarks = ns["benchmarks"]

    def scores(self, deltas: dict[str, np.ndarray]) -> dict[str, float]:
        return self.benchmarks(deltas, self.sig, self.q0, len(DELTA_SEEDS))

    @property
    def base_scores(self) -> dict[str, float]:
        return self.scores({n: np.zeros_like(d) for n, d in self.b.items()})

    def expert_scores(self) -> list[dict[str, float]]:
        return [self.scores(d) for d in self.deltas]

    def task_arithmetic(self, lam: float) -> dict[str, float]:
        return self.scores({n: lam * sum(d[n] for d in self.deltas) for n in self.names})


@pytest.fixture(scope="module")
def experts(tmp_path_factory) -> Experts:
    return Experts(tmp_path_factory.mktemp("experts"))


def ref_multi_expert(
    base: dict, fts: list[dict], cand: dict, targets: list[str], margin: float = 0.5
) -> tuple[float | None, float | None, float | None]:
    """% repair, % retention and HM for several experts, straight from the definitions: a target
    or a benchmark the best expert improved (beyond the margin) is scored against the best
    expert, targets counted in % retention; any other against the worst expert."""
    rep, ret = [], []
    for k, b in base.items():
        best, worst = max(f[k] for f in fts), min(f[k] for f in fts)
        if k in targets or best > b + margin:
            ret.append((cand[k] - b) / (best - b) * 100)
        elif worst < b - margin:
            rep.append((cand[k] - worst) / (b - worst) * 100)
    r = float(np.mean(rep)) if rep else None
    t = float(np.mean(ret)) if ret else None
    if r is None or t is None:
        return r, t, r if t is None else t
    hm = 2 * r * t / (r + t) if r > 0 and t > 0 else min(r, t)
    return r, t, hm


# -- the scoring, on hand numbers --------------------------------------------------------------


def test_expert_reference_and_pooled_retention_by_hand():
    base = {"d0": Score(40.0), "d1": Score(40.0), "gen": Score(70.0), "chat": Score(50.0)}
    e0 = {"d0": Score(80.0), "d1": Score(10.0), "gen": Score(40.0), "chat": Score(50.2)}
    e1 = {"d0": Score(12.0), "d1": Score(78.0), "gen": Score(60.0), "chat": Score(49.9)}
    ref, chosen = expert_reference(base, [e0, e1], targets=["d1"])
    # d0: improved by e0 (best); d1: a target (best, e1); gen: no expert improved it, the worst
    # (e0) damaged it; chat: the best moved it by 0.2 < the 0.5 floor, so the worst, unchanged
    assert {k: (v["expert"], v["rule"]) for k, v in chosen.items()} == {
        "d0": (0, "best"),
        "d1": (1, "best"),
        "gen": (0, "worst"),
        "chat": (1, "worst"),
    }
    assert [ref[k].value for k in ("d0", "d1", "gen", "chat")] == [80.0, 78.0, 40.0, 49.9]
    cand = {"d0": 60.0, "d1": 55.0, "gen": 64.0, "chat": 50.0}
    doc = score_candidates(base, ref, [("c", cand)], targets=["d1"], targets_in_retention=True)
    (cd,) = doc["candidates"]
    retention = ((60 - 40) / (80 - 40) * 100 + (55 - 40) / (78 - 40) * 100) / 2
    repair = (64 - 40) / (70 - 40) * 100
    assert abs(cd["retention"] - retention) < 1e-12 and abs(cd["repair"] - repair) < 1e-12
    assert abs(cd["hm"] - 2 * repair * retention / (repair + retention)) < 1e-12
    assert abs(cd["target_retention"]["d1"] - (55 - 40) / (78 - 40) * 100) < 1e-12
    # normalised accuracy: the improved benchmark and the target, each over its expert's score
    assert abs(cd["normalised_accuracy"] - (60 / 80 + 55 / 78) / 2 * 100) < 1e-12
    assert doc["counts"] == {"damaged": 1, "improved": 1, "unchanged": 1, "target": 1}
    # one fine-tune: targets stay apart from % retention (score's definitions, unchanged)
    single = score_candidates(base, e1, [("c", cand)], targets=["d1"])["candidates"][0]
    assert single["retention"] is None and single["hm"] == single["repair"]
    assert abs(single["normalised_accuracy"] - 55 / 78 * 100) < 1e-12  # d0 is damaged by e1: out
    # no benchmark damaged by any expert: a note, not a warning
    quiet = {"d0": Score(80.0), "d1": Score(78.0), "gen": Score(70.0), "chat": Score(50.0)}
    d2 = score_candidates(base, quiet, [("c", cand)], targets=["d1"], targets_in_retention=True)
    assert d2["notes"] and not any("repair" in w for w in d2["warnings"])
    # as the sweep scores several fine-tunes: an unchanged skill of the base (chat: no expert
    # moved it) is in % repair as the share of the base's level kept, c/b
    d3 = score_candidates(
        base, ref, [("c", cand)], targets=["d1"], targets_in_retention=True, unchanged_in_repair=True
    )
    (c3,) = d3["candidates"]
    assert abs(c3["repair"] - ((64 - 40) / (70 - 40) * 100 + 50.0 / 50.0 * 100) / 2) < 1e-12
    assert abs(c3["retention"] - retention) < 1e-12 and d3["unchanged_in_repair"] is True
    lost = {**cand, "chat": 10.0}  # keeps the gains, loses a skill every expert kept
    (c4,) = score_candidates(
        base, ref, [("c", lost)], targets=["d1"], targets_in_retention=True, unchanged_in_repair=True
    )["candidates"]
    assert abs(c4["repair"] - (80.0 + 10.0 / 50.0 * 100) / 2) < 1e-12 and c4["hm"] < c3["hm"]
    # nothing damaged, gen and chat unchanged: % repair is their kept share, and the note says so
    d5 = score_candidates(
        base, quiet, [("c", cand)], targets=["d1"], targets_in_retention=True, unchanged_in_repair=True
    )
    (c5,) = d5["candidates"]
    assert abs(c5["repair"] - (64.0 / 70.0 * 100 + 50.0 / 50.0 * 100) / 2) < 1e-12
    assert any("share of the base's level kept on the 2 unchanged" in n for n in d5["notes"])


# -- the sweep ---------------------------------------------------------------------------------


def _sweep(experts: Experts, out: Path, **kw) -> dict:
    opts = SweepOptions(
        eval_template=experts.template,
        extra_fts=[str(f) for f in experts.fts[1:]],
        targets=list(TARGETS),
        plot=False,
        device="cpu",
        **kw,
    )
    return sweep(experts.base, experts.fts[0], out, opts)


@pytest.fixture(scope="module")
def swept(experts, tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("swept") / "merged"
    return _sweep(experts, out, budget=16), out


def test_multi_expert_scores_match_the_float64_reference(experts, swept):
    doc, _ = swept
    base_s, ft_s = experts.base_scores, experts.expert_scores()
    assert doc["scoring"]["reference"] == "experts" and doc["scoring"]["retention_includes_targets"]
    for i, t in enumerate(TARGETS):  # each domain's reference is its own expert
        assert doc["scoring"]["experts"][t] == {"expert": i, "rule": "best", "fine_tune": str(experts.fts[i])}
    assert {doc["scoring"]["experts"][k]["rule"] for k in ("general", "math")} == {"worst"}
    assert doc["counts"] == {"damaged": 2, "improved": 0, "unchanged": 0, "target": 3}
    assert doc["options"]["min_target_retention"] is None  # no bar by default with several
    rows = [r for r in doc["candidates"] if r["status"] == "ok"]
    assert len(rows) == doc["budget"]["candidate_evaluations"] == 12
    for r in rows:
        cand = {b["name"]: b["value"] for b in r["benchmarks"]}
        if r["family"] == "task-arithmetic" and r["axis"] == "lambda":  # the weights, from numpy
            want = experts.task_arithmetic(r["params"]["lambda"])
            assert all(abs(cand[k] - want[k]) < 1e-3 for k in want), (r["name"], cand, want)
        rep, ret, hm = ref_multi_expert(base_s, ft_s, cand, TARGETS)
        assert abs(r["repair"] - rep) < 1e-3 and abs(r["retention"] - ret) < 1e-3, r["name"]
        assert abs(r["hm"] - hm) < 1e-3, (r["name"], r["hm"], hm)
        norm = np.mean([cand[t] / max(f[t] for f in ft_s) * 100 for t in TARGETS])
        assert abs(r["normalised_accuracy"] - norm) < 1e-3, (r["name"], r["normalised_accuracy"], norm)
    best = max(r["hm"] for r in rows)
    assert doc["winner"] is not None and abs(doc["winner"]["hm"] - best) < 1e-9
    assert not any("undefined" in w for w in doc["warnings"])


def test_the_strength_search_starts_small_and_follows_up_the_best_merge(swept):
    doc, _ = swept
    strength = [f for f in doc["families"] if f.get("origin") == "merges"]
    assert [f["family"] for f in strength][:4] == ["task-arithmetic", "ties", "dare-ties", "dg-hard"]
    assert all(f["axis"] == "lambda" and f["grid"] == [0.3, 0.6, 1.0] for f in strength[:4])
    coarse = [r for r in doc["candidates"] if r["phase"] == "coarse"]
    # round-robin, smallest strength first: every family's first grid value before any second
    n = len(strength)
    assert [r["value"] for r in coarse[:n]] == [f["grid"][0] for f in strength]
    assert [f["grid"][0] for f in strength] == [0.3] * 4 + [1.0] * (n - 4)  # the subspace merges' own grid
    follow = [f for f in doc["families"] if str(f.get("origin", "")).startswith("follow-up")]
    assert follow and any(f["axis"] == "alpha,beta" and f["command"] == "merge" for f in follow)
    scheduled = [r for r in doc["candidates"] if r["axis"] == "lines"]
    assert scheduled and all(r["command"] == "merge" and "lines" in r["params"] for r in scheduled)
    assert [r["phase"] for r in scheduled][:2] == ["follow-up", "follow-up"]
    # the follow-ups start from the best strength candidates found before them: the best family's
    # first, then every family within 2 HM points of it (the noise margin) gets its own schedule
    first_follow = min(r["order"] for r in doc["candidates"] if r["entry"] in {f["index"] for f in follow})
    before = [r for r in doc["candidates"] if r["order"] < first_follow and r["hm"] is not None]
    best_of: dict = {}
    for r in before:
        if r["family"] not in best_of or r["hm"] > best_of[r["family"]]["hm"]:
            best_of[r["family"]] = r
    top = max(r["hm"] for r in before)
    near = {f for f, r in best_of.items() if r["hm"] >= top - 2.0}
    params = [{k: v for k, v in r["params"].items() if k != "lines"} for r in scheduled]
    assert params[0] == max(before, key=lambda r: r["hm"])["params"]
    # the best merge, once with --calibrate svc at its strength
    (svc,) = [f for f in follow if f["fixed"].get("calibrate") == "svc"]
    top_row = max(before, key=lambda r: r["hm"])
    assert svc["family"] == top_row["family"] and svc["grid"] == [top_row["value"]] and not svc["refine"]
    calibrated = [r for r in doc["candidates"] if r["entry"] == svc["index"]]
    assert [r["params"] for r in calibrated] == [{**top_row["params"], "calibrate": "svc"}]
    assert calibrated[0]["status"] == "ok" and calibrated[0]["hm"] != top_row["hm"]  # SVC changed the merge
    assert {p["method"] for p in params} <= near
    for p in params:
        assert p == best_of[p["method"]]["params"]


def test_families_within_the_tie_tolerance_each_get_their_schedule_tried(experts, tmp_path):
    """With a tie tolerance that puts several families within noise of the best, the follow-ups
    schedule each family's own best merge (the best family's first), not only the best one's."""
    doc = _sweep(experts, tmp_path / "wide", budget=24, tie_tolerance=100.0)  # a reserve of 5: 2 families
    scheduled = [r for r in doc["candidates"] if r["axis"] == "lines"]
    methods = [r["params"]["method"] for r in scheduled]
    assert len(set(methods)) >= 2, methods
    first_follow = min(r["order"] for r in scheduled)
    before = [r for r in doc["candidates"] if r["order"] < first_follow and r["hm"] is not None]
    assert methods[0] == max(before, key=lambda r: r["hm"])["params"]["method"]
    for r in scheduled:
        own = [b for b in before if b["params"]["method"] == r["params"]["method"]]
        want = max(own, key=lambda b: b["hm"])["params"]
        assert {k: v for k, v in r["params"].items() if k != "lines"} == want


def test_the_normalised_accuracy_objective_searches_and_chooses_on_the_new_skills_alone(
    experts, swept, tmp_path
):
    """``--objective normalised-accuracy``: the winner, the refinements and the follow-ups all
    follow the merging literature's score (the targets over their experts), not HM, which also
    weighs the base's damaged skills; ``--fail-under`` gates on it."""
    from dghard_cli.cli.render_sweep import _progress_tail

    events: list = []
    doc = _sweep(
        experts,
        tmp_path / "na",
        budget=16,
        objective="normalised-accuracy",
        fail_under=1000.0,
        on_event=events.append,
    )
    assert doc["options"]["objective"] == "normalised-accuracy"
    # the progress lines name the objective's value of the best so far
    last = [e for e in events if e.get("kind") == "candidate"][-1]
    assert "normalised accuracy" in _progress_tail(last) and "(HM" not in _progress_tail(last)
    rows = [r for r in doc["candidates"] if r["status"] == "ok"]
    best = max(r["normalised_accuracy"] for r in rows)
    w = doc["winner"]
    assert w is not None and w["normalised_accuracy"] == best
    # on the same coarse grid, HM and normalised accuracy disagree on the best merge
    hm_doc, _ = swept
    coarse = lambda d: {r["name"]: r for r in d["candidates"] if r["phase"] == "coarse"}  # noqa: E731
    a, b = coarse(doc), coarse(hm_doc)
    assert a.keys() == b.keys()
    assert (
        max(a.values(), key=lambda r: r["normalised_accuracy"])["name"]
        != max(b.values(), key=lambda r: r["hm"])["name"]
    )
    # the follow-ups start from the best merge by the objective
    follow = [r for r in doc["candidates"] if r["phase"] == "follow-up"]
    assert follow
    before = [r for r in rows if r["order"] < min(f["order"] for f in follow)]
    top = max(before, key=lambda r: r["normalised_accuracy"])
    assert {k: v for k, v in follow[0]["params"].items() if k not in ("lines", "calibrate")} == top["params"]
    # the table shows the objective's column and the winner line its value
    import io

    from rich.console import Console

    from dghard_cli.cli.render_sweep import render_sweep

    buf = io.StringIO()
    render_sweep(Console(file=buf, width=250), doc)
    text = buf.getvalue()
    assert "norm. acc. %" in text and f"normalised accuracy {best:.1f} %" in text
    assert doc["gate"]["objective"] == "normalised-accuracy" and doc["gate"]["value"] == best
    assert doc["gate"]["passed"] is False and "normalised accuracy" in doc["gate"]["reason"]


def test_an_unknown_objective_is_refused_in_one_line(experts, tmp_path):
    from dghard_cli.errors import InputError

    with pytest.raises(
        InputError, match=r"--objective 'accuracy' is not one of hm, retention, normalised-accuracy"
    ):
        _sweep(experts, tmp_path / "bad", budget=2, objective="accuracy")
    assert not (tmp_path / "bad").exists()


def test_a_winner_where_the_single_fine_tune_bar_finds_none(experts, swept, tmp_path):
    doc, _ = swept
    # what the one-fine-tune default asked (every target keeps 90 % of its expert's gain):
    # interference keeps every merge's domains far below that, so that sweep has no winner
    worst = max(min(r["target_retention"].values()) for r in doc["candidates"] if r["status"] == "ok")
    assert worst < 90
    strict = _sweep(experts, tmp_path / "strict", budget=5, min_target_retention=90.0)
    assert strict["winner"] is None and "--min-target-retention" in strict["no_winner_reason"]
    assert doc["winner"] is not None and doc["winner"]["hm"] > 0


def test_the_printed_command_rewrites_the_merge_winner_byte_for_byte(swept, tmp_path):
    from typer.testing import CliRunner

    from dghard_cli.cli import app

    doc, out = swept
    argv = doc["winner"]["reproduce"]["argv"]
    assert argv[:3] == ["dghard", "merge", "--method"] and len([a for a in argv if "/e1" in a]) == 3
    again = Path(doc["winner"]["reproduce"]["out"])
    res = CliRunner().invoke(app, [*argv[1:], "--quiet"])
    assert res.exit_code == 0, res.output

    def sha(p: Path) -> str:
        return hashlib.sha256(p.read_bytes()).hexdigest()

    names = sorted(p.name for p in out.glob("*.safetensors"))
    assert names and names == sorted(p.name for p in again.glob("*.safetensors"))
    assert [sha(out / n) for n in names] == [sha(again / n) for n in names]
    assert json.loads((out / "dghard_report.json").read_text())["argv"] == argv


def test_a_lines_merge_candidate_is_written_by_its_printed_command(experts, tmp_path):
    from typer.testing import CliRunner

    from dghard_cli.cli import app
    from dghard_cli.sweeping.families import make_candidate, reproduce_argv, write_candidate
    from dghard_cli.sweeping.lines_candidates import LinesEntry

    ta = make_candidate(_entry("task-arithmetic", "lambda"), 0.4, n_fts=3)
    e = LinesEntry(family="lines", grid=[], axis="lines", merge_params=ta.params, fine_tunes="several")
    cand = make_candidate(e, (0.2, 1.6), n_fts=3)
    fts = [str(f) for f in experts.fts]
    argv = reproduce_argv(cand, str(experts.base), fts, str(tmp_path / "a"), "cpu")
    assert "--lines" in argv and argv[argv.index("--lines") + 1] == "0.2,1.6"
    write_candidate(cand, str(experts.base), fts, tmp_path / "a", device="cpu", argv=argv)
    args = [str(tmp_path / "b") if a == str(tmp_path / "a") else a for a in argv[1:]]
    res = CliRunner().invoke(app, [*args, "--quiet"])
    assert res.exit_code == 0, res.output
    for p in sorted((tmp_path / "a").glob("*.safetensors")):
        assert p.read_bytes() == (tmp_path / "b" / p.name).read_bytes()
    # and the weights are the schedule times the merge: W_base + (α + β·ℓ/(L−1))·0.4·ΣΔ
    w = load_dir(tmp_path / "a")
    for n in experts.names:
        layer = int(n.split(".")[2]) if n.startswith("model.layers.") else None
        lam = 0.2 if layer is None and "embed" in n else 0.2 + 1.6 * (layer if layer is not None else 1)
        want = experts.b[n] + lam * 0.4 * sum(d[n] for d in experts.deltas)
        assert np.max(np.abs(f64(w[n]) - want)) < 1e-6, n


def _entry(family: str, axis: str):
    from dghard_cli.sweeping.candidate_file import parse_candidates

    (e,) = parse_candidates({"families": [{"family": family, "axis": axis, "grid": [0.4]}]}, "x")
    return e


# -- the default candidate set -----------------------------------------------------------------


def test_every_registered_method_with_a_sweep_axis_joins_the_default_set(monkeypatch):
    import pkgutil
    import types

    from dghard_cli.methods import registry
    from dghard_cli.methods.declare import MergeMethod
    from dghard_cli.sweeping import merges
    from dghard_cli.sweeping.candidate_file import load_candidates

    entries, _ = load_candidates(None)
    several = [e for e in entries if e.applies(3)]
    assert all(e.origin == "merges" for e in several)
    want = [
        m.name
        for m in registry.methods().values()
        if m.sweep_axes and m.fine_tunes != "one" and not m.calibrates
    ]
    # excluded by the default file: variants, and methods not yet measured on the real model
    block = {
        "dare-linear",
        "breadcrumbs",
        "breadcrumbs-ties",
        "della",
        "della-linear",
        "star",
        "cart",
    }
    assert [e.family for e in several] == [m for m in want if m not in block]
    own = {"tsv", "iso-c", "iso-cts"}  # the subspace merges' α: a grid of their own (merges.methods)
    for e in several:
        assert e.grid == sorted(e.grid)  # from small strengths up
        if e.family in own:
            assert e.grid == [1.0, 1.4, 2.0] and e.range == (0.5, 3.0), e.describe()
        elif e.family == "wudi":  # its default scale, refined when it leads
            assert e.grid == [1.0] and e.range == (0.3, 1.5), e.describe()
        else:
            assert e.grid == [0.3, 0.6, 1.0] and e.range == (0.1, 1.5), e.describe()
        assert e.axis == ("lambda" if "lambda" in e.kind.axes else e.kind.axes[0])
    # a method module found by the registry (as dghard_cli/methods/<name>.py would be) whose
    # strength is alpha joins as it is, after the sweep modules were imported
    name = "dghard_cli.methods._toy_merge_for_test"
    mod = types.ModuleType(name)
    mod.MERGE_METHODS = (MergeMethod("toy-merge", ("alpha",), lambda p, ctx: None, sweep_axes=("alpha",)),)
    real = pkgutil.iter_modules

    def iter_modules(path=None, prefix=""):
        yield from real(path, prefix)
        if path is not None and any(str(p).endswith("methods") for p in path):
            yield pkgutil.ModuleInfo(None, name.rsplit(".", 1)[1], False)

    monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(registry.pkgutil, "iter_modules", iter_modules)
    registry.registry.cache_clear()
    try:
        entries, _ = load_candidates(None)
        (added,) = [e for e in entries if e.family == "toy-merge"]
        assert added.axis == "alpha" and added.range == (0.1, 1.0) and added.grid == [0.3, 0.6, 1.0]
        assert (
            added.kind.command == "merge" and merges.strength_axis(registry.methods()["toy-merge"]) == "alpha"
        )
    finally:
        registry.registry.cache_clear()


@pytest.mark.parametrize(
    "block, message",
    [
        ({"grid": []}, "non-empty list of strengths"),
        ({"grid": [0.3], "range": [1.0, 0.5]}, "'range' must be [low, high]"),
        ({"grid": [2.0], "range": [0.1, 1.5]}, "outside range"),
        ({"grid": [0.3], "range": [0.1, 1.5], "exclude": ["magic"]}, "is not a merge method"),
        (  # as the default file's comment once invited: listed to be swept, and dropped silently
            {"grid": [0.3], "range": [0.1, 1.5], "methods": {"star": {"grid": [0.5]}}, "exclude": ["star"]},
            "star is under both 'methods' and 'exclude'",
        ),
        ({"grid": [0.3], "range": [0.1, 1.5], "lines": [[0.5]]}, "is not a pair"),
        ({"grid": [0.3], "range": [0.1, 1.5], "density": [1.5]}, "must be in (0, 1]"),
        ({"grid": [0.3], "range": [0.1, 1.5], "colour": 1}, "unknown key 'colour'"),
        ({"grid": [0.3], "range": [0.1, 1.5], "methods": {"magic": {"grid": [1]}}}, "is not a merge method"),
        (
            {"grid": [0.3], "range": [0.1, 1.5], "methods": {"tsv": {"grid": [2.0]}}},
            "tsv: grid value 2 lies outside",
        ),
        (
            {"grid": [0.3], "range": [0.1, 1.5], "methods": {"tsv": {"grid": [1], "step": 1}}},
            "with 'grid' and",
        ),
        ({"grid": [0.3], "range": [0.1, 1.5], "methods": [1]}, "'methods' must map"),
        (
            {"grid": [0.3], "range": [0.1, 1.5], "calibrate": ["svd"]},
            "calibrate 'svd': --calibrate must be svc",
        ),
        ({"grid": [0.3], "range": [0.1, 1.5], "calibrate": {"svc": 1}}, "'calibrate' must be a list"),
        ({"grid": [0.3], "range": [0.1, 1.5], "calibrate": False}, "'calibrate' must be a list"),
    ],
)
def test_merges_block_errors_name_the_key(block, message):
    from dghard_cli.errors import InputError
    from dghard_cli.sweeping.candidate_file import parse_candidates

    with pytest.raises(InputError) as e:
        parse_candidates({"merges": block}, "c.yaml")
    assert message in str(e.value) and str(e.value).startswith("c.yaml: merges")


def test_a_method_given_its_own_grid_and_range_in_the_merges_block():
    from dghard_cli.sweeping.candidate_file import parse_candidates

    block = {
        "grid": [0.3, 0.6],
        "range": [0.1, 1.5],
        "methods": {"iso-c": {"grid": [0.8, 2.5], "range": [0.5, 4]}},
    }
    by = {e.family: e for e in parse_candidates({"merges": block}, "c.yaml")}
    assert by["iso-c"].followups["calibrate"] == []  # no post-step unless the block names one
    by_svc = parse_candidates({"merges": {**block, "calibrate": "svc"}}, "c.yaml")
    assert all(e.followups["calibrate"] == ["svc"] for e in by_svc)
    # searched as given, past α's declared 3 as a family entry's own range is (never clipped: a
    # grid outside the clipped range was silently replaced by its midpoint)
    assert by["iso-c"].grid == [0.8, 2.5] and by["iso-c"].range == (0.5, 4.0)
    assert by["task-arithmetic"].grid == [0.3, 0.6] and by["task-arithmetic"].range == (0.1, 1.5)
    # a grid alone takes the block's range
    block["methods"] = {"tsv": {"grid": [1.2]}}
    by = {e.family: e for e in parse_candidates({"merges": block}, "c.yaml")}
    assert by["tsv"].grid == [1.2] and by["tsv"].range == (0.1, 1.5) and by["iso-c"].grid == [0.3, 0.6]


def test_the_follow_ups_of_a_ties_merge_fix_its_strength(experts):
    from dghard_cli.io.checkpoint import Checkpoint
    from dghard_cli.sweeping import merges
    from dghard_cli.sweeping.candidate_file import load_candidates
    from dghard_cli.sweeping.families import make_candidate, reproduce_argv

    entries, _ = load_candidates(None)
    (ties,) = [e for e in entries if e.family == "ties" and e.origin == "merges"]
    best = make_candidate(ties, 0.45, n_fts=3)
    base, ft = Checkpoint(experts.base, label="BASE"), Checkpoint(experts.fts[0], label="FT")
    try:
        (dens, sched, svc), notes = merges.followups(ties, best, 40, base, ft)
    finally:
        base.close()
        ft.close()
    # the schedule before SVC: at a small budget the round-robin reaches it first, as before SVC
    assert not notes and (dens.index, sched.index, svc.index) == (40, 41, 42)
    # the SVC follow-up: the best merge itself, once, with --calibrate svc
    assert (
        svc.family == "ties" and svc.grid == [0.45] and not svc.refine and svc.fixed == {"calibrate": "svc"}
    )
    c = make_candidate(svc, 0.45, n_fts=3)
    assert dict(c.params) == {**dict(best.params), "calibrate": "svc"}
    assert "calibrate=svc" in c.label and c.label != best.label  # told apart in every table
    argv = reproduce_argv(c, "B", ["F1", "F2", "F3"], "OUT", "auto")
    assert argv[argv.index("--calibrate") + 1] == "svc" and argv[argv.index("--lambda") + 1] == "0.45"
    assert dens.family == "ties" and dens.axis == "density" and dens.grid == [0.1, 0.5]
    assert dens.fixed == {"lambda": 0.45} and dens.log
    assert make_candidate(dens, 0.2, n_fts=3).params == best.params  # its centre is the best itself
    assert sched.merge_params == best.params and sched.grid_pairs == [(0.5, 1.0), (0.2, 1.6)]
    c = make_candidate(sched, (0.5, 1.0), n_fts=3)
    assert c.command == "merge" and c.family == "ties" and dict(c.params)["lines"] == (0.5, 1.0)
    # a method without a density axis gets SVC and the schedule; a family other than the best
    # (density=False) the schedule alone
    (ta,) = [e for e in entries if e.family == "task-arithmetic" and e.origin == "merges"]
    base, ft = Checkpoint(experts.base, label="BASE"), Checkpoint(experts.fts[0], label="FT")
    try:
        (_, svc), _ = merges.followups(ta, make_candidate(ta, 0.3, n_fts=3), 7, base, ft)
        (only,), _ = merges.followups(ta, make_candidate(ta, 0.3, n_fts=3), 7, base, ft, density=False)
    finally:
        base.close()
        ft.close()
    assert only.axis == "lines" and dict(only.merge_params)["lambda"] == 0.3


def _interrupted(experts, out, monkeypatch, at: int, **kw) -> None:
    """A sweep stopped by Ctrl-C while its ``at``-th evaluation runs (its cache kept)."""
    import os
    import signal
    import time

    from dghard_cli.errors import Interrupted
    from dghard_cli.sweeping import jobs

    real, calls = jobs.run_command, []

    def interrupt(*args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while this evaluation runs
            time.sleep(1)
            raise RuntimeError("stopped by the interruption")
        return real(*args, **kwargs)

    monkeypatch.setattr(jobs, "run_command", interrupt)
    with pytest.raises(Interrupted):
        _sweep(experts, out, **kw)
    monkeypatch.setattr(jobs, "run_command", real)


def test_an_interrupted_merge_sweep_resumes_and_derives_the_same_follow_ups(
    experts, swept, tmp_path, monkeypatch
):
    doc, _ = swept
    out = tmp_path / "resumed"
    # 4 references, then the 8th candidate: before the follow-ups
    _interrupted(experts, out, monkeypatch, 12, budget=16)
    again = _sweep(experts, out, budget=16)
    assert again["budget"]["from_cache"] == 11 and again["budget"]["run_now"] == 16 - 11
    assert [r["name"] for r in again["candidates"]] == [r["name"] for r in doc["candidates"]]
    assert again["winner"]["name"] == doc["winner"]["name"]


def test_a_sweep_resumed_with_another_objective_reuses_its_evaluations(experts, tmp_path, monkeypatch):
    out = tmp_path / "resumed"
    _interrupted(experts, out, monkeypatch, 8, budget=10)  # 4 references, then the 4th candidate
    again = _sweep(experts, out, budget=10, objective="normalised-accuracy")
    assert again["budget"]["from_cache"] == 7 and again["options"]["objective"] == "normalised-accuracy"
    rows = [r for r in again["candidates"] if r["status"] == "ok"]
    assert again["winner"]["normalised_accuracy"] == max(r["normalised_accuracy"] for r in rows)


def test_followups_go_to_every_family_within_noise_of_the_best():
    """A family a little behind on strength alone gets its schedule tried too (within the
    noise margin, or --tie-tolerance if larger), best first, as many as the reserve allows."""
    from dghard_cli.sweeping import merges

    def row(entry, hm, order, feasible=1):
        return {"entry": entry, "objective": (feasible, hm, -0.5), "order": order}

    rows = [row(0, 80.0, 1), row(0, 84.0, 5), row(1, 85.5, 2), row(2, 83.4, 3), row(3, 70.0, 4)]
    rows.append(row(4, 90.0, 6, feasible=0))  # another feasibility class: never "near"
    got = merges.followup_families(rows, 0.0, 32)
    assert [(r["entry"], r["objective"][1]) for r in got] == [(1, 85.5), (0, 84.0)]
    wide = merges.followup_families(rows, 3.0, 32)
    assert [r["entry"] for r in wide] == [1, 0, 2]
    assert [r["entry"] for r in merges.followup_families(rows, 3.0, 8)] == [1]  # a reserve of 2
    # the best family's density follow-up takes its share of the reserve (8 - 4 = 4: 2 families)
    assert [r["entry"] for r in merges.followup_families(rows, 3.0, 32, density_evals=4)] == [1, 0]
    assert merges.followup_families([], 0.0, 32) == []
    # no feasible merge yet: the ranking's second key is a retention, not HM: the best only
    infeasible = [row(0, 50.0, 1, feasible=0), row(1, 49.5, 2, feasible=0)]
    assert [r["entry"] for r in merges.followup_families(infeasible, 3.0, 32)] == [0]
