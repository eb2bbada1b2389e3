"""`dghard sweep` end to end on a generated pair, with a stand-in evaluation whose scores are a
known function of the candidate's weights, so the best candidate can be computed here from
float64 numpy references (SVD filters, WiSE-FT, the scoring definitions) independently of the
package."""

from __future__ import annotations

import json
import math
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, f64, interrupt_hanging_sweep, load_dir, run_dghard
from reference import ref_weights

from dghard_cli.errors import InputError
from dghard_cli.sweeping.candidate_file import load_candidates, parse_candidates
from dghard_cli.sweeping.families import make_candidate
from dghard_cli.sweeping.run import SweepOptions, staging_path, sweep
from dghard_cli.sweeping.search import coarse_allotment, coarse_order, next_round, refine_probe, refine_probes
from dghard_cli.testing.synthetic import ArchConfig, DeltaModel, decoder_tensors, make_pair, signal_and_noise

CFG = ArchConfig(
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=1,
    vocab_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
)
DM = DeltaModel(strengths=[5.0, 2.5, 1.3, 1.05], noise=2e-3)
SEED = 7

# The stand-in benchmarks, a function of every matrix's update D = W - W_base:
#   p = sum <D, S> / sum ||S||^2       the share of the planted task signal S the model carries
#   q = sum ||(I - U U^T) D||^2 / the same for the fine-tune   the update outside S's column space
# task = 40 + 40 p rises with the signal (improved by the fine-tune); general and math fall with
# the noise the fine-tune brought (damaged); chat barely moves (unchanged).
FORMULA = """
def benchmarks(deltas, sig, q0):
    num = den = q = 0.0
    for name, d in deltas.items():
        s, u = sig["S:" + name], sig["U:" + name]
        num += float(np.sum(d * s))
        den += float(np.sum(s * s))
        q += float(np.sum((d - u @ (u.T @ d)) ** 2))
    p, q = num / den, q / q0
    return {"task": 40 + 40 * p, "general": 70 - 30 * q, "math": 60 - 20 * q ** 0.5, "chat": 50 + 0.1 * q}
"""

EVAL_SCRIPT = (
    """
import json, os, sys, time
from pathlib import Path
import numpy as np
from safetensors.numpy import load_file

ROOT = Path(__file__).parent
model, output = sys.argv[1], sys.argv[2]
name = os.environ.get("DGHARD_CANDIDATE", "?")
log = ROOT / "calls.log"
with open(log, "a") as fh:
    fh.write(f"start\\t{name}\\n")
n_started = sum(1 for line in log.read_text().splitlines() if line.startswith("start"))
hang_after = os.environ.get("SWEEP_HANG_AFTER")
if hang_after and n_started > int(hang_after):
    (ROOT / "hanging").write_text(str(os.getpid()))
    time.sleep(120)
for var, what in (("SWEEP_FAIL_ON", "fail"), ("SWEEP_GARBAGE_ON", "garbage"), ("SWEEP_HANG_ON", "hang"),
                  ("SWEEP_MISSING_ON", "missing")):
    if os.environ.get(var) and os.environ[var] in name:
        if what == "fail":
            print("loading model ...")
            print("boom: simulated evaluation crash", file=sys.stderr)
            sys.exit(3)
        if what == "garbage":
            Path(output).write_text("{not json")
            sys.exit(0)
        if what == "hang":
            time.sleep(120)
        if what == "missing":
            Path(output).write_text(json.dumps({"task": 50.0}))
            sys.exit(0)

def load(d):
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out
"""
    + FORMULA
    + """
sig = np.load(ROOT / "signal.npz")
q0 = float(sig["q0"])
b, m = load(ROOT / "base"), load(model)
names = [k[2:] for k in sig.files if k.startswith("S:")]
deltas = {n: m[n].astype(np.float64) - b[n].astype(np.float64) for n in names}
res = benchmarks(deltas, sig, q0)
if os.environ.get("SWEEP_HUGE_ON") and os.environ["SWEEP_HUGE_ON"] in name:
    res["task"] = float(os.environ.get("SWEEP_HUGE_VALUE", "1.7e308"))  # finite, but no benchmark's
if output == "-":  # a template without {output}: the results JSON on stdout
    print(json.dumps(res))
elif os.environ.get("SWEEP_LM_EVAL"):  # the lm-evaluation-harness layout, in a directory
    out = Path(output) / "org__model"
    out.mkdir(parents=True)
    doc = {"results": {k: {"alias": k, "acc,none": v / 100, "acc_stderr,none": 0.0} for k, v in res.items()}}
    (out / "results_2025-01-01T00-00-00.json").write_text(json.dumps(doc))
else:
    Path(output).write_text(json.dumps(res))
with open(log, "a") as fh:
    fh.write(f"done\\t{name}\\n")
"""
)

CANDIDATES = """
families:
  - family: hard
    grid: [1.0, 3.0]
    range: [0.5, 8.0]
  - family: soft
    grid: [0.5, 1.5]
    range: [0.1, 4.0]
  - family: optimal
    grid: [1.0, 3.0]
    range: [0.5, 8.0]
  - family: twoknob
    axis: b
    grid: [0.2, 0.5]
    fixed: {a: 1.0, scale: 1.0}
  - family: wise-ft
    grid: [0.4, 0.7]
"""
BUDGET = 14  # base + FT + 12 candidates: 9 coarse points, then refinement


class Pair:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.base, self.ft = make_pair(root, CFG, dtype="float32", ft_shards=2, seed=SEED, delta=DM)
        b, f = load_dir(self.base), load_dir(self.ft)
        self.names = [n for n, shape in decoder_tensors(CFG) if len(shape) == 2]
        arrays, q0 = {}, 0.0
        self.deltas = {}
        for n in self.names:
            s, _ = signal_and_noise(n, tuple(b[n].shape), SEED, DM)
            s = s.numpy()
            u = np.linalg.svd(s, full_matrices=False)[0][:, : DM.rank]
            arrays["S:" + n], arrays["U:" + n] = s, u
            d = f64(f[n]) - f64(b[n])
            self.deltas[n] = d
            q0 += float(np.sum((d - u @ (u.T @ d)) ** 2))
        np.savez(root / "signal.npz", q0=q0, **arrays)
        self.sig = dict(np.load(root / "signal.npz"))
        self.q0 = q0
        self.script = root / "evaluate.py"
        self.script.write_text(EVAL_SCRIPT)
        self.template = f"{shlex.quote(sys.executable)} {shlex.quote(str(self.script))} {{model}} {{output}}"
        self.candidates = root / "candidates.yaml"
        self.candidates.write_text(CANDIDATES)
        ns: dict = {"np": np}
        exec(FORMULA, ns)
        self.benchmarks = ns["benchmarks"]
        self.svd = {n: np.linalg.svd(d, full_matrices=False) for n, d in self.deltas.items()}

    # -- the independent reference -------------------------------------------------------------
    def filtered(self, family: str, params: dict) -> dict[str, np.ndarray]:
        """Every matrix's update in the candidate, from float64 numpy (SVD filters / WiSE-FT;
        the lines family: the update, or the filtered one, times λ of the matrix's layer)."""
        out = {}
        for n, d in self.deltas.items():
            if family == "wise-ft":
                out[n] = params["alpha"] * d
                continue
            if family == "lines":
                lam = ref_layer_strength(n, params)
                if "shrink" not in params:
                    out[n] = lam * d
                    continue
                u, s, vt = self.svd[n]
                w, _ = ref_weights(s, d.shape, shrink=params["shrink"], scale=params["scale"])
                out[n] = lam * ((u * (w * s)) @ vt)
                continue
            u, s, vt = self.svd[n]
            kw = {k: params[k] for k in ("a", "b") if k in params}
            w, _ = ref_weights(s, d.shape, shrink=params["shrink"], scale=params["scale"], **kw)
            out[n] = (u * (w * s)) @ vt
        return out

    def scores(self, deltas: dict[str, np.ndarray]) -> dict[str, float]:
        return self.benchmarks(deltas, self.sig, self.q0)

    def hm(self, family: str, params: dict) -> float:
        return ref_hm(self.base_scores, self.ft_scores, self.scores(self.filtered(family, params)))

    @property
    def base_scores(self) -> dict[str, float]:
        return self.scores({n: np.zeros_like(d) for n, d in self.deltas.items()})

    @property
    def ft_scores(self) -> dict[str, float]:
        return self.scores(self.deltas)

    def calls(self) -> list[tuple[str, str]]:
        log = self.root / "calls.log"
        if not log.exists():
            return []
        return [tuple(line.split("\t", 1)) for line in log.read_text().splitlines()]  # type: ignore[misc]

    def reset_calls(self) -> None:
        (self.root / "calls.log").unlink(missing_ok=True)
        (self.root / "hanging").unlink(missing_ok=True)


def ref_layer_strength(name: str, params: dict) -> float:
    """λ of a tensor of the one-block test model: ``--lines a,b`` gives the embeddings a, the
    head a + b and the single block a + b/2 (midway); ``--layer-strengths`` names each group."""
    place = (
        "embed"
        if name.startswith("model.embed_tokens.")
        else "0"
        if name.startswith("model.layers.0.")
        else "head"
    )
    if "lines" in params:
        a, b = params["lines"]
        return {"embed": a, "0": a + b / 2, "head": a + b}[place]
    table = dict(item.split("=") for item in params["layer_strengths"].split(","))
    return float(table[place])


def ref_hm(base: dict, ft: dict, cand: dict, margin: float = 0.5) -> float:
    """% repair, % retention and their harmonic mean, straight from the definitions."""
    rep = [(cand[k] - ft[k]) / (base[k] - ft[k]) * 100 for k in base if ft[k] < base[k] - margin]
    ret = [(cand[k] - base[k]) / (ft[k] - base[k]) * 100 for k in base if ft[k] > base[k] + margin]
    r, t = sum(rep) / len(rep), sum(ret) / len(ret)
    return 2 * r * t / (r + t) if r > 0 and t > 0 else min(r, t)


def dense_best(pair: Pair, points: int = 80) -> tuple[float, str, float]:
    """The best HM over a dense scan of every family's range (the sweep cannot beat it)."""
    entries, _ = load_candidates(pair.candidates)
    best = (-math.inf, "", 0.0)
    for e in entries:
        us = np.linspace(e.coord(e.lo), e.coord(e.hi), points)
        for u in us:
            v = e.value(float(u))
            cand = make_candidate(e, v, n_fts=1)
            best = max(best, (pair.hm(e.family, cand.param_dict), e.family, v))
    return best


def alive(pid: int) -> bool:
    """A running process (a zombie, killed and waiting for a parent to reap it, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def out_files(out: Path) -> set[str]:
    return {p.name for p in out.iterdir()}


def no_leftovers(parent: Path) -> None:
    left = [p.name for p in parent.iterdir() if p.name.startswith(".")]
    assert left == [], left


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Pair:
    return Pair(tmp_path_factory.mktemp("sweep pair"))  # a space in every path: quoting is tested


@pytest.fixture(scope="module")
def uninterrupted(pair: Pair, tmp_path_factory) -> tuple[dict, Path, list]:
    pair.reset_calls()
    parent = tmp_path_factory.mktemp("out dir")
    out = parent / "winner"
    doc = sweep(
        pair.base,
        pair.ft,
        out,
        SweepOptions(eval_template=pair.template, budget=BUDGET, candidates=pair.candidates, plot=True),
    )
    calls = pair.calls()
    return doc, out, calls


# -- the sweep finds the best candidate ---------------------------------------------------------


def test_sweep_finds_the_best_candidate_within_the_budget(pair, uninterrupted):
    doc, out, calls = uninterrupted
    done = [c for c in calls if c[0] == "done"]
    assert len(done) == BUDGET == doc["budget"]["used"]  # base, FT and 12 candidates, nothing more
    assert doc["budget"]["reference_evaluations"] == 2 and doc["budget"]["candidate_evaluations"] == 12
    assert {c["phase"] for c in doc["candidates"]} == {"coarse", "refine"}

    base_s, ft_s = pair.base_scores, pair.ft_scores
    assert doc["counts"] == {"damaged": 2, "improved": 1, "unchanged": 1, "target": 0}
    # every candidate's HM is what the float64 reference of its family and parameters gives
    ref = {}
    for c in doc["candidates"]:
        assert c["status"] == "ok", c
        ref[c["name"]] = ref_hm(base_s, ft_s, pair.scores(pair.filtered(c["family"], c["params"])))
        assert abs(c["hm"] - ref[c["name"]]) < 1e-4, (c["name"], c["hm"], ref[c["name"]])
    # the winner is the best of them (ties: the closest to the fine-tune)
    best = max(ref.values())
    tied = [c for c in doc["candidates"] if ref[c["name"]] >= best - 1e-9]
    expect = min(tied, key=lambda c: (c["distance"], c["order"]))
    assert doc["winner"]["name"] == expect["name"]
    # ... and within a point of the best any strength of any family reaches
    dense_hm, fam, val = dense_best(pair)
    assert doc["winner"]["hm"] >= dense_hm - 1.0, (doc["winner"], dense_hm, fam, val)
    # the distance to the fine-tune is ||W_c − W_ft|| / ||W_ft − W_base|| over every tensor
    w = pair.filtered(expect["family"], expect["params"])
    b, f = load_dir(pair.base), load_dir(pair.ft)
    num = den = 0.0
    for n in f:
        d = f64(f[n]) - f64(b[n])
        if n in w:
            c = w[n]
        else:  # norms: the fine-tune's value (repair) or the interpolation (WiSE-FT)
            c = expect["params"]["alpha"] * d if expect["family"] == "wise-ft" else d
        num += float(np.sum((c - d) ** 2))
        den += float(np.sum(d**2))
    assert abs(doc["winner"]["distance"] - math.sqrt(num / den)) < 1e-5

    # OUT holds the winner's checkpoint as repair writes it, the sweep report and the plot; no
    # temporary directory is left beside it
    ft_files = {p.name for p in pair.ft.iterdir()}
    assert out_files(out) == (
        ft_files | {"dghard_report.json", "README.md", "sweep_report.json", "sweep_frontier.png"}
    )
    no_leftovers(out.parent)
    on_disk = json.loads((out / "sweep_report.json").read_text())
    assert on_disk["winner"]["name"] == doc["winner"]["name"] and on_disk["kind"] == "sweep"
    assert (out / "sweep_frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rep = json.loads((out / "dghard_report.json").read_text())
    assert rep["argv"] == doc["winner"]["reproduce"]["argv"] and rep["output"]["path"] == str(out)
    # one candidate on disk at a time besides the winner
    assert doc["disk"]["peak_bytes"] <= 2 * doc["disk"]["candidate_bytes_max"]


def test_the_printed_command_writes_the_winner_byte_for_byte(pair, uninterrupted, tmp_path):
    doc, out, _ = uninterrupted
    argv = doc["winner"]["reproduce"]["argv"]
    assert argv[:2] in (["dghard", "repair"], ["dghard", "merge"])
    # verbatim: it writes beside OUT (OUT holds the winner already)
    again = Path(doc["winner"]["reproduce"]["out"])
    assert str(again) == str(out) + "-reproduced" and str(again) in argv and str(out) not in argv
    r = run_dghard(*argv[1:], "--quiet")
    assert r.returncode == 0, r.stderr
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert shards == sorted(p.name for p in again.glob("*.safetensors")) and shards
    for name in shards:
        assert (out / name).read_bytes() == (again / name).read_bytes(), name


# -- interrupted and resumed --------------------------------------------------------------------


def test_an_interrupted_sweep_resumes_without_evaluating_anything_twice(pair, uninterrupted, tmp_path):
    doc0, _, _ = uninterrupted
    pair.reset_calls()
    out = tmp_path / "resumed out"
    args = [
        "sweep",
        pair.base,
        pair.ft,
        out,
        "--eval",
        pair.template,
        "--budget",
        BUDGET,
        "--candidates",
        pair.candidates,
    ]
    marker = pair.root / "hanging"
    proc, env = interrupt_hanging_sweep(args, marker, hang_after=7, wait=60)
    stderr = proc.stderr
    assert proc.returncode == 3, stderr
    assert "interrupted" in stderr and "run the same command again" in stderr
    eval_pid = int(marker.read_text())
    assert not alive(eval_pid)  # the hanging evaluation was taken down with the sweep
    assert not out.exists() and staging_path(out).is_dir()
    first = pair.calls()
    finished = [n for what, n in first if what == "done"]
    assert len(finished) == 7  # base, FT, five candidates; the eighth was interrupted

    pair.reset_calls()
    # a mistyped rerun is refused and leaves the cache of the interrupted run alone
    r = run_dghard(*args, "--target", "tsak", env=env)
    assert r.returncode == 2 and "--target 'tsak': no such benchmark" in r.stderr
    assert staging_path(out).is_dir() and pair.calls() == []
    r = run_dghard(*args, "--json", env=env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    second = [n for what, n in pair.calls() if what == "done"]
    assert not set(second) & set(finished), "an evaluation finished before the interruption ran again"
    assert len(finished) + len(second) == BUDGET
    assert doc["budget"]["from_cache"] == 7 and doc["budget"]["run_now"] == BUDGET - 7
    assert sum(1 for c in doc["candidates"] if c["cached"]) == 5
    # the resumed sweep took the same steps and chose the same winner as an uninterrupted one
    assert [c["name"] for c in doc["candidates"]] == [c["name"] for c in doc0["candidates"]]
    assert doc["winner"]["name"] == doc0["winner"]["name"]
    assert not staging_path(out).exists()
    no_leftovers(out.parent)


# -- failures are reported per candidate -------------------------------------------------------


def test_failing_hanging_and_unreadable_evaluations_are_reported_not_fatal(pair, tmp_path, monkeypatch):
    pair.reset_calls()
    cands = tmp_path / "c.yaml"
    cands.write_text(
        "families:\n"
        "  - {family: hard, grid: [1.0], refine: false}\n"
        "  - {family: soft, grid: [0.5], refine: false}\n"
        "  - {family: optimal, grid: [1.0], refine: false}\n"
        "  - {family: wise-ft, grid: [0.5], refine: false}\n"
        "  - {family: twoknob, grid: [0.3], refine: false}\n"
    )
    monkeypatch.setenv("SWEEP_FAIL_ON", "soft")
    monkeypatch.setenv("SWEEP_GARBAGE_ON", "optimal")
    monkeypatch.setenv("SWEEP_HANG_ON", "wise-ft")
    monkeypatch.setenv("SWEEP_MISSING_ON", "twoknob")
    monkeypatch.setenv("SWEEP_LM_EVAL", "1")  # results as lm-evaluation-harness writes them
    out = tmp_path / "it's out"  # a quote in the path: placeholders are shell-quoted
    doc = sweep(
        pair.base,
        pair.ft,
        out,
        SweepOptions(eval_template=pair.template, budget=7, candidates=cands, eval_timeout=3),
    )
    status = {c["family"]: c for c in doc["candidates"]}
    assert status["hard"]["status"] == "ok"
    assert status["soft"]["status"] == "failed"
    assert "exited with status 3: boom: simulated evaluation crash" in status["soft"]["message"]
    assert "boom" in status["soft"]["log_tail"]
    assert status["optimal"]["status"] == "unreadable" and "not valid JSON" in status["optimal"]["message"]
    assert status["wise-ft"]["status"] == "timeout" and "timed out after 3 s" in status["wise-ft"]["message"]
    assert status["twoknob"]["status"] == "unreadable"
    assert "no score for benchmark 'general'" in status["twoknob"]["message"]
    assert doc["winner"]["family"] == "hard"
    # lm-eval fractions were read as points, as `score` reads them
    assert abs(doc["references"]["ft"]["retention"] - 100.0) < 1e-9
    assert abs(status["hard"]["hm"] - pair.hm("hard", status["hard"]["params"])) < 1e-4
    assert "sweep_report.json" in out_files(out) and "model.safetensors.index.json" in out_files(out)
    no_leftovers(tmp_path)


@pytest.mark.parametrize("value", ["1.7e308", "-1.7e308", "2e12"])
def test_an_extreme_finite_score_marks_the_candidate_unreadable(pair, tmp_path, monkeypatch, value):
    """A score past any benchmark's range (which the sweep's means, differences and harmonic
    means would overflow) is refused where it is read, naming the file, benchmark and value."""
    pair.reset_calls()
    cands = _write_text(
        tmp_path / "c.yaml",
        "families:\n  - {family: hard, grid: [1.0], refine: false}\n"
        "  - {family: wise-ft, grid: [0.5], refine: false}\n",
    )
    monkeypatch.setenv("SWEEP_HUGE_ON", "wise-ft")
    monkeypatch.setenv("SWEEP_HUGE_VALUE", value)
    out = tmp_path / "out"
    r = run_dghard("sweep", pair.base, pair.ft, out, "--eval", pair.template, "--candidates", cands,
                   "--budget", "4", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    doc = json.loads(r.stdout, parse_constant=lambda c: pytest.fail(f"literal {c} in the report"))
    status = {c["family"]: c for c in doc["candidates"]}
    assert status["wise-ft"]["status"] == "unreadable" and status["wise-ft"]["hm"] is None
    msg = status["wise-ft"]["message"]
    assert "'task'" in msg and f"{float(value):.6g}" in msg and "beyond what any benchmark" in msg
    assert doc["winner"]["family"] == "hard"
    text = (out / "sweep_report.json").read_text()
    assert "Infinity" not in text and "NaN" not in text


def test_bad_template_failing_base_and_bad_options_are_clear_errors(pair, tmp_path):
    pair.reset_calls()
    out = tmp_path / "out"
    r = run_dghard("sweep", pair.base, pair.ft, out, "--eval", pair.template.replace("{model} ", ""))
    assert r.returncode == 2
    assert "has no {model} placeholder" in r.stderr and "Traceback" not in r.stderr
    assert pair.calls() == [] and not out.exists()  # nothing ran, nothing was written
    no_leftovers(tmp_path)

    # the base cannot be evaluated: nothing to compare with, a clear message, nothing left behind
    r = run_dghard(
        "sweep",
        pair.base,
        pair.ft,
        out,
        "--eval",
        pair.template,
        "--budget",
        "4",
        env={"SWEEP_FAIL_ON": "BASE"},
    )
    assert r.returncode == 2
    assert "the evaluation of BASE failed" in r.stderr and "boom" in r.stderr
    assert not out.exists()
    no_leftovers(tmp_path)

    def bad(**kw):
        opts = {"eval_template": pair.template, "candidates": pair.candidates, **kw}
        with pytest.raises(InputError) as e:
            sweep(pair.base, pair.ft, out, SweepOptions(**opts))
        assert not out.exists() or list(out.iterdir()) == [out / "x"]
        no_leftovers(tmp_path)
        return str(e.value)

    assert "leaves no evaluation for a candidate" in bad(budget=2)
    assert "--eval-timeout" in bad(eval_timeout=0.0)
    assert "no such benchmark" in bad(
        targets=["nope"], base_results=_write(tmp_path / "b.json", pair.base_scores)
    )
    assert "no candidate family applies" in bad(
        candidates=_write_text(tmp_path / "m.yaml", "families:\n  - {family: ties, grid: [0.3]}\n")
    )
    (out / "x").parent.mkdir()
    (out / "x").write_text("keep me")
    assert "not empty" in bad()
    (out / "x").unlink()
    out.rmdir()


def _write(path: Path, doc: dict) -> Path:
    path.write_text(json.dumps(doc))
    return path


def _write_text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# -- choice rule, gate, --json ----------------------------------------------------------------


def test_given_results_target_constraint_gate_and_json(pair, tmp_path):
    pair.reset_calls()
    b, f = _write(tmp_path / "b.json", pair.base_scores), _write(tmp_path / "f.json", pair.ft_scores)
    cands = _write_text(
        tmp_path / "c.yaml",
        "families:\n  - {family: hard, grid: [1.0, 3.0, 6.0], refine: false}\n  - {family: wise-ft, grid: [0.5], refine: false}\n",
    )
    out = tmp_path / "gate"
    args = ["sweep", pair.base, pair.ft, out, "--eval", pair.template, "--candidates", cands]
    args += ["--base-results", b, "--ft-results", f, "--budget", "4", "--target", "task"]
    r = run_dghard(*args, "--min-target-retention", "95", "--fail-under", "99", "--json")
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)  # exactly one JSON document on stdout
    assert len([c for c in pair.calls() if c[0] == "done"]) == 4  # given results cost no budget
    assert doc["budget"] == {**doc["budget"], "reference_evaluations": 0, "candidate_evaluations": 4}
    assert doc["counts"]["target"] == 1 and doc["counts"]["improved"] == 0
    # with the task as a target, HM is % repair alone, subject to >= 95 % target retention
    base_s, ft_s = pair.base_scores, pair.ft_scores
    rows = []
    for c in doc["candidates"]:
        s = pair.scores(pair.filtered(c["family"], c["params"]))
        rep = np.mean([(s[k] - ft_s[k]) / (base_s[k] - ft_s[k]) * 100 for k in ("general", "math")])
        tgt = (s["task"] - base_s["task"]) / (ft_s["task"] - base_s["task"]) * 100
        assert abs(c["hm"] - rep) < 1e-4 and abs(c["target_retention"]["task"] - tgt) < 1e-4
        assert c["feasible"] == (tgt >= 95)
        rows.append((tgt >= 95, rep, c["name"]))
    feasible = [x for x in rows if x[0]]
    assert feasible and len(feasible) < len(rows)  # the constraint decides something
    assert doc["winner"]["name"] == max(feasible)[2]
    assert doc["gate"]["passed"] is False and "below --fail-under 99" in doc["gate"]["reason"]
    assert "below --fail-under 99" in r.stderr
    assert "model.safetensors.index.json" in out_files(out)  # the winner is still written

    # nobody keeps the target: no winner, exit 1, OUT has the report only
    out2 = tmp_path / "none"
    r = run_dghard(*[out2 if a == out else a for a in args], "--min-target-retention", "101", "--quiet")
    assert r.returncode == 1 and "no winner" in r.stderr
    assert out_files(out2) <= {
        "sweep_report.json",
        "sweep_frontier.png",
    } and "sweep_report.json" in out_files(out2)
    no_leftovers(tmp_path)


def test_merge_methods_with_two_fine_tunes(pair, tmp_path):
    pair.reset_calls()
    # a second fine-tune of the same base (same seed, another update)
    _, ft2 = make_pair(
        tmp_path / "second", CFG, dtype="float32", ft_shards=1, seed=SEED, delta=DM, delta_seed=11
    )
    cands = _write_text(
        tmp_path / "c.yaml",
        "families:\n"
        "  - {family: hard, grid: [1.0]}\n"  # one fine-tune only: skipped
        "  - {family: task-arithmetic, grid: [0.5, 1.0], refine: false}\n"
        "  - {family: ties, grid: [0.3], refine: false, fixed: {weights: [1.0, 0.5]}}\n",
    )
    out = tmp_path / "merged"
    doc = sweep(
        pair.base,
        pair.ft,
        out,
        SweepOptions(eval_template=pair.template, budget=6, candidates=cands, extra_fts=[str(ft2)]),
    )
    assert [s["family"] for s in doc["skipped_families"]] == ["hard"]
    assert doc["budget"]["reference_evaluations"] == 3 and doc["budget"]["candidate_evaluations"] == 3
    # the reference "FT" score of each benchmark is its expert's: the best fine-tune where one
    # improved it beyond the margin, else the worst (the damage to a skill of the base)
    scores2 = pair.scores(
        {n: f64(t) - f64(load_dir(pair.base)[n]) for n, t in load_dir(ft2).items() if n in pair.names}
    )
    for bm in doc["benchmarks"]:
        k = bm["name"]
        best, worst = max(pair.ft_scores[k], scores2[k]), min(pair.ft_scores[k], scores2[k])
        improved = best > pair.base_scores[k] + 0.5
        assert doc["scoring"]["experts"][k]["rule"] == ("best" if improved else "worst")
        assert abs(bm["ft"] - (best if improved else worst)) < 1e-4
    assert {bm["name"]: bm["partition"] for bm in doc["benchmarks"]}["task"] == "improved"
    argv = doc["winner"]["reproduce"]["argv"]
    assert argv[:3] == ["dghard", "merge", "--method"] and str(ft2) in argv
    again = Path(doc["winner"]["reproduce"]["out"])
    r = run_dghard(*argv[1:], "--quiet")  # verbatim
    assert r.returncode == 0, r.stderr
    for p in out.glob("*.safetensors"):
        assert p.read_bytes() == (again / p.name).read_bytes()


# -- the candidate file and the search ---------------------------------------------------------


def test_default_candidate_set_is_shipped_and_valid():
    shipped = (REPO / "configs" / "sweep-default.yaml").read_bytes()
    packaged = (REPO / "dghard_cli" / "data" / "sweep-default.yaml").read_bytes()
    assert shipped == packaged
    entries, _ = load_candidates(None)
    fams = [e.family for e in entries]
    assert {"lines", "hard", "soft", "optimal", "twoknob", "wise-ft"} <= set(fams)
    assert [e.family for e in entries if e.applies(1)] == [
        "lines",
        "hard",
        "soft",
        "optimal",
        "twoknob",
        "wise-ft",
    ]
    assert all(
        not e.applies(1) for e in entries if e.family in ("ties", "task-arithmetic", "dare-ties", "dg-hard")
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("families: []", "non-empty list"),
        ("families:\n  - {family: magic, grid: [1]}", "'family' must be one of"),
        ("families:\n  - {family: hard, grid: [1], colour: red}", "unknown key 'colour'"),
        ("families:\n  - {family: hard, grid: []}", "non-empty list of numbers"),
        ("families:\n  - {family: hard, grid: [20]}", "outside range"),
        ("families:\n  - {family: hard, grid: [1], axis: alpha}", "cannot be swept for hard"),
        (
            "families:\n  - {family: twoknob, grid: [0.5], range: [0, 2], axis: scale}",
            "log axis needs range low > 0",
        ),
        (
            "families:\n  - {family: twoknob, grid: [0.5], fixed: {b: 0.1}}",
            "swept axis and cannot also be fixed",
        ),
        ("families:\n  - {family: hard, grid: [1], fixed: {alpha: 1}}", "cannot be fixed for hard"),
        ("families:\n  - {family: wise-ft, grid: [0.5], fine_tunes: several}", "exactly one fine-tune"),
        ("families:\n  - {family: wise-ft, grid: [0.5], range: [0, 2]}", "--alpha must be in [0, 1]"),
        ("families:\n  - {family: soft, grid: [1], fixed: {noise: known}}", "--noise known needs --sigma"),
        ("colour: red\nfamilies:\n  - {family: hard, grid: [1]}", "unknown top-level key"),
    ],
)
def test_candidate_file_errors_name_the_entry(text, message):
    import yaml

    with pytest.raises(InputError) as e:
        parse_candidates(yaml.safe_load(text), "c.yaml")
    assert message in str(e.value) and str(e.value).startswith("c.yaml")


def test_golden_section_refinement_finds_the_optimum_of_a_unimodal_axis():
    (entry,) = parse_candidates(
        {"families": [{"family": "hard", "grid": [1.0, 4.0], "range": [0.25, 16.0], "tolerance": 0.005}]}, "x"
    )
    peak = 2.3

    def obj(v: float) -> tuple:
        return (1, -((math.log(v) - math.log(peak)) ** 2))

    coarse = coarse_order([entry], 1)
    evaluated: dict = {}
    values = []
    rounds = []
    for _ in range(40):
        batch = next_round(
            [entry],
            1,
            coarse,
            evaluated,
            sum(1 for c in coarse if c.params in evaluated),
            2,
            lambda e: max(evaluated.values()) if evaluated else None,
        )
        if not batch:
            break
        rounds.append([phase for _, phase in batch])
        for cand, phase in batch:  # a round depends only on earlier rounds
            values.append((cand.value, phase))
            evaluated[cand.params] = obj(cand.value)
    assert rounds[0] == ["coarse", "coarse"]  # the coarse grid is one round
    assert all(r == ["refine"] * len(r) and len(r) <= 2 for r in rounds[1:])  # both neighbours at once
    assert any(len(r) == 2 for r in rounds[1:])
    best = max(values, key=lambda vp: obj(vp[0]))[0]
    assert abs(math.log(best / peak)) < 0.02
    assert len(values) < 30  # stops by itself once the bracket is below the tolerance
    # a refinement probe never repeats a point
    assert len({v for v, _ in values}) == len(values)
    assert refine_probe(entry, {1.0: None, 4.0: None}) is None  # nothing succeeded: nothing to refine
    assert refine_probes(entry, {1.0: None, 4.0: None}) == []


def test_a_golden_section_step_probes_both_sides_wider_first():
    (entry,) = parse_candidates(
        {"families": [{"family": "wise-ft", "grid": [0.5], "range": [0.0, 1.0], "tolerance": 0.02}]}, "x"
    )
    # best 0.5, neighbours 0.2 (left, width 0.3) and 1.0 (range end, width 0.5): right first
    probes = refine_probes(entry, {0.2: (1, 1.0), 0.5: (1, 2.0)})
    g = (3 - math.sqrt(5)) / 2
    assert probes == [round(0.5 + g * 0.5, 4), round(0.5 - g * 0.3, 4)]
    assert refine_probe(entry, {0.2: (1, 1.0), 0.5: (1, 2.0)}) == probes[0]
    # a side narrower than the tolerance is not probed
    assert refine_probes(entry, {0.49: (1, 1.0), 0.5: (1, 2.0), 0.51: (1, 1.0)}) == []


def test_coarse_points_go_round_robin_and_leave_room_to_refine():
    entries = parse_candidates(
        {"families": [{"family": "hard", "grid": [1, 2, 3]}, {"family": "wise-ft", "grid": [0.5]}]}, "x"
    )
    order = [(c.family, c.value) for c in coarse_order(entries, 1)]
    assert order == [("hard", 1.0), ("wise-ft", 0.5), ("hard", 2.0), ("hard", 3.0)]
    assert coarse_allotment(12, 10, 5) == 9  # a quarter of the budget is kept for refinement
    assert coarse_allotment(4, 10, 5) == 4  # but every entry gets a point first when possible
    assert coarse_allotment(20, 10, 5) == 10


def test_a_template_without_output_reads_the_results_from_stdout(pair, tmp_path):
    pair.reset_calls()
    cands = _write_text(tmp_path / "c.yaml", "families:\n  - {family: soft, grid: [0.7], refine: false}\n")
    template = pair.template.replace("{output}", "-")
    doc = sweep(
        pair.base, pair.ft, tmp_path / "out", SweepOptions(eval_template=template, budget=3, candidates=cands)
    )
    (row,) = doc["candidates"]
    assert row["status"] == "ok" and doc["winner"]["name"] == row["name"] == "soft scale=0.7"
    assert abs(row["hm"] - pair.hm("soft", row["params"])) < 1e-4


@pytest.mark.parametrize(
    "entry, n_fts",
    [
        ({"family": "hard", "grid": [1.7], "fixed": {"noise": "known", "sigma": 0.002}}, 1),
        ({"family": "soft", "grid": [0.8]}, 1),
        ({"family": "optimal", "grid": [2.5]}, 1),
        ({"family": "twoknob", "axis": "a", "grid": [0.9], "fixed": {"b": 0.1, "scale": 1.5}}, 1),
        ({"family": "wise-ft", "grid": [0.35]}, 1),
        ({"family": "task-arithmetic", "grid": [0.7], "fixed": {"weights": [1.0, 0.5]}}, 2),
        ({"family": "ties", "grid": [0.3], "fixed": {"lambda": 0.9}}, 2),
        ({"family": "dare-linear", "grid": [0.5], "fixed": {"seed": 3}}, 2),
        ({"family": "dare-ties", "axis": "lambda", "grid": [0.8], "fixed": {"density": 0.4}}, 2),
        ({"family": "dg-hard", "grid": [2.0], "fixed": {"weights": [1.0, 1.0]}}, 2),
        ({"family": "lines", "grid": [[0.3, 0.45]]}, 1),
        ({"family": "lines", "grid": [[0.15, 0.7]], "fixed": {"shrink": "hard", "scale": 1.2}}, 1),
        ({"family": "lines", "grid": [[0.25, 0.5]], "fixed": {"shrink": "twoknob", "a": 1.0, "b": 0.3}}, 1),
    ],
    ids=lambda x: x["family"] if isinstance(x, dict) else str(x),
)
def test_every_family_is_reproduced_by_its_printed_command(pair, tmp_path, entry, n_fts):
    """The command line the sweep prints writes the candidate the sweep wrote, byte for byte."""
    from typer.testing import CliRunner

    from dghard_cli.cli import app
    from dghard_cli.sweeping.families import reproduce_argv, write_candidate

    fts = [str(pair.ft)]
    if n_fts == 2:
        fts.append(str(pair.root / "ft2"))
        if not (pair.root / "ft2").exists():
            make_pair(
                pair.root / "second", CFG, dtype="float32", ft_shards=1, seed=SEED, delta=DM, delta_seed=11
            )
            (pair.root / "second" / "ft").rename(pair.root / "ft2")
    (e,) = parse_candidates({"families": [entry]}, "x")
    cand = make_candidate(e, e.grid[0], n_fts=n_fts)
    argv = reproduce_argv(cand, str(pair.base), fts, str(tmp_path / "a"), "cpu")
    write_candidate(cand, str(pair.base), fts, tmp_path / "a", device="cpu", argv=argv)
    args = [str(tmp_path / "b") if a == str(tmp_path / "a") else a for a in argv[1:]]
    res = CliRunner().invoke(app, [*args, "--quiet"])
    assert res.exit_code == 0, res.output
    shards = sorted(p.name for p in (tmp_path / "a").glob("*.safetensors"))
    assert shards == sorted(p.name for p in (tmp_path / "b").glob("*.safetensors")) and shards
    for name in shards:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    rep = json.loads((tmp_path / "b" / "dghard_report.json").read_text())
    params = cand.param_dict
    for k, v in params.items():
        if k in rep["parameters"]:
            assert rep["parameters"][k] == v, k
