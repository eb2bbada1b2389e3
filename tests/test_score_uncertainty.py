"""HM's standard error (``dghard score``) against a simulation with known truth.

Benchmarks of n items, each a Bernoulli draw with a known true accuracy per model, scored as
lm-eval scores them (accuracy in points and its sample standard error). Over many simulated
evaluations, the spread of the HM computed from the draws must match the delta-method standard
error :mod:`dghard_cli.scoring.uncertainty` reports from one evaluation's stderrs, where the
three evaluations are independent (the module's assumption); and must not exceed it where the
models share their items (a real benchmark), which makes their differences vary less.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from dghard_cli.scoring.metrics import harmonic_mean, score_candidates
from dghard_cli.scoring.uncertainty import hm_partials, uncertainty

#: true accuracies (%) of base, fine-tune and candidate on two damaged and two improved benchmarks
TRUE = {
    "facts": (80.0, 55.0, 70.0),
    "sums": (70.0, 45.0, 60.0),
    "code": (30.0, 60.0, 50.0),
    "chat": (40.0, 75.0, 62.0),
}


def _evaluate(rng: np.random.Generator, n: int, shared: bool) -> list[dict]:
    """Three result dicts {benchmark: (points, stderr)}: independent draws, or one set of items
    (a latent difficulty per item, so the models' correct answers correlate)."""
    out: list[dict] = [{}, {}, {}]
    for k, ps in TRUE.items():
        u = rng.random(n) if shared else None
        for i, p in enumerate(ps):
            draws = (u if shared else rng.random(n)) < p / 100.0
            acc = draws.mean()
            out[i][k] = (100.0 * acc, 100.0 * math.sqrt(max(acc * (1 - acc), 1e-12) / (n - 1)))
    return out


def _hm_and_se(res: list[dict]) -> tuple[float, float]:
    doc = score_candidates(res[0], res[1], {"c": res[2]}, margin=5.0)
    assert doc["counts"]["damaged"] == 2 and doc["counts"]["improved"] == 2
    cd = doc["candidates"][0]
    return cd["hm"], cd["hm_stderr"]


@pytest.mark.parametrize("n", [200, 800])
def test_hm_stderr_matches_the_spread_of_hm_over_independent_evaluations(n):
    rng = np.random.default_rng(n)
    hms, ses = zip(*(_hm_and_se(_evaluate(rng, n, shared=False)) for _ in range(1500)), strict=True)
    spread, reported = float(np.std(hms, ddof=1)), float(np.mean(ses))
    assert reported == pytest.approx(spread, rel=0.12), (spread, reported)


def test_hm_stderr_is_on_the_large_side_when_the_models_share_items():
    rng = np.random.default_rng(1)
    hms, ses = zip(*(_hm_and_se(_evaluate(rng, 300, shared=True)) for _ in range(1500)), strict=True)
    spread, reported = float(np.std(hms, ddof=1)), float(np.mean(ses))
    assert reported >= spread, (spread, reported)


def test_partials_against_finite_differences():
    for r, t in [(60.0, 30.0), (5.0, 90.0), (-10.0, 40.0), (40.0, -5.0)]:
        h = 1e-6
        d_r = (harmonic_mean(r + h, t) - harmonic_mean(r - h, t)) / (2 * h)
        d_t = (harmonic_mean(r, t + h) - harmonic_mean(r, t - h)) / (2 * h)
        assert hm_partials(r, t) == pytest.approx((d_r, d_t), rel=1e-6, abs=1e-9)


def test_an_unknown_stderr_makes_hm_stderr_unknown_not_zero():
    base = {"facts": (80.0, 1.0), "code": (30.0, 1.0)}
    ft = {"facts": (55.0, 1.0), "code": (60.0, 1.0)}
    doc = score_candidates(base, ft, {"a": {"facts": 70.0, "code": 50.0}}, margin=5.0)
    cd = doc["candidates"][0]
    assert cd["hm"] is not None and cd["hm_stderr"] is None and cd["repair_stderr"] is None
    doc = score_candidates(base, ft, {"a": {"facts": (70.0, 2.0), "code": (50.0, 2.0)}}, margin=5.0)
    cd = doc["candidates"][0]
    # one damaged and one improved benchmark: R = 60, T = 66.7, straight from the definitions
    se_r = math.sqrt((100 / 25 * 2) ** 2 + (100 * 15 / 625 * 1) ** 2 + (100 * 10 / 625 * 1) ** 2)
    se_t = math.sqrt((100 / 30 * 2) ** 2 + (100 * 10 / 900 * 1) ** 2 + (100 * 20 / 900 * 1) ** 2)
    assert cd["repair_stderr"] == pytest.approx(se_r) and cd["retention_stderr"] == pytest.approx(se_t)
    r, t = cd["repair"], cd["retention"]
    d_r, d_t = 2 * t**2 / (r + t) ** 2, 2 * r**2 / (r + t) ** 2
    assert cd["hm_stderr"] == pytest.approx(math.hypot(d_r * se_r, d_t * se_t))


def test_hm_that_is_one_mean_alone_has_that_means_stderr():
    from dghard_cli.scoring.results import Score

    bms = [
        {"name": "x", "partition": "damaged", "base": 80.0, "ft": 60.0, "base_stderr": 1.0, "ft_stderr": 1.0}
    ]
    se = uncertainty({"x": Score(70.0, 1.0)}, bms, 50.0, None)
    assert se["retention_stderr"] is None and se["hm_stderr"] == se["repair_stderr"] > 0


def _files_with_items(tmp_path, rng: np.random.Generator, n: int, as_fraction: bool):
    """base/ft/candidate JSON files whose benchmarks list their items (0/1 on shared items)."""
    import json

    from dghard_cli.scoring.results import read_results

    docs: list[dict] = [{}, {}, {}]
    for k, ps in TRUE.items():
        u = rng.random(n)
        for i, p in enumerate(ps):
            xs = (u < p / 100.0).astype(float)
            score = xs.mean() if as_fraction else 100.0 * xs.mean()
            docs[i][k] = {"score": float(score), "items": xs.tolist()}
    paths = []
    for name, d in zip(("base", "ft", "c"), docs, strict=True):
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(d))
        paths.append(read_results(p))
    return paths


@pytest.mark.parametrize("as_fraction", [False, True])
def test_items_compare_the_models_item_by_item_and_match_the_spread(tmp_path, as_fraction):
    """With per-item results (0/1, the same items for every model) the standard error is paired:
    it matches the spread of HM over re-drawn item sets, where the benchmark-stderr route was
    2.3x too large."""
    rng = np.random.default_rng(3)
    hms, ses, paired = [], [], set()
    for _ in range(300):
        b, f, c = _files_with_items(tmp_path, rng, 300, as_fraction)
        doc = score_candidates(b, f, {"c": c}, margin=5.0)
        cd = doc["candidates"][0]
        hms.append(cd["hm"])
        ses.append(cd["hm_stderr"])
        paired.add(cd["stderr_paired_benchmarks"])
    assert paired == {4}
    spread, reported = float(np.std(hms, ddof=1)), float(np.mean(ses))
    assert reported == pytest.approx(spread, rel=0.2), (spread, reported)


def test_items_that_do_not_average_to_the_score_are_refused(tmp_path):
    import json

    from dghard_cli.errors import InputError
    from dghard_cli.scoring.results import read_results

    p = tmp_path / "r.json"
    for items, why in (
        ([1, 0, 1], "average 0.666667, not the score"),
        ([1], "at least 2"),
        (["x", 1], "finite"),
    ):
        p.write_text(json.dumps({"arc": {"score": 50.0, "items": items}}))
        with pytest.raises(InputError, match=why):
            read_results(p)
    p.write_text(json.dumps({"arc": {"score": 50.0, "items": [1, 0, 0, 1]}}))
    assert read_results(p).scores["arc"].items == (100.0, 0.0, 0.0, 100.0)


def test_lm_eval_logged_samples_are_the_items(tmp_path):
    """``lm_eval --log_samples`` writes ``samples_<task>_<time>.jsonl`` beside
    ``results_<time>.json``: each record's ``doc_id``, ``filter`` and metric value are a task's
    items, in doc_id order; samples that do not average to the score are not used (a warning)."""
    import json

    from dghard_cli.scoring.results import read_results

    stamp = "2026-12-07T10-00-00.000001"
    d = tmp_path / "out" / "model"
    d.mkdir(parents=True)
    results = {
        "results": {
            "arc": {"acc,none": 0.5, "acc_stderr,none": 0.25},
            "hella": {"acc_norm,none": 0.75, "acc_norm_stderr,none": 0.2, "acc,none": 0.1},
        }
    }
    (d / f"results_{stamp}.json").write_text(json.dumps(results))
    arc = [(3, True), (0, True), (2, False), (1, False), (1, 1.0)]  # the last: another filter
    lines = [{"doc_id": i, "filter": "none", "acc": v} for i, v in arc[:4]]
    lines.append({"doc_id": 1, "filter": "strict", "acc": arc[4][1]})
    (d / f"samples_arc_{stamp}.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    hella = [{"doc_id": i, "filter": "none", "acc_norm": 1.0, "acc": 0.0} for i in range(3)]
    (d / f"samples_hella_{stamp}.jsonl").write_text("\n".join(json.dumps(x) for x in hella))
    rf = read_results(tmp_path / "out")
    assert rf.scores["arc"].items == (100.0, 0.0, 0.0, 100.0)  # doc_id 0, 1, 2, 3
    assert rf.scores["arc"].value == 50.0
    assert rf.scores["hella"].items is None  # averages 1.0, not its score 0.75
    assert any("hella" in w and "not paired" in w for w in rf.warnings), rf.warnings


def test_hm_stderr_where_repair_equals_retention_is_the_smooth_one():
    """At R = T > 0 the partials of 2RT/(R+T) are (0.5, 0.5): the min rule took max(se) there."""
    base = {"a": (60.0, 2.0), "b": (40.0, 2.0)}
    ft = {"a": (40.0, 2.0), "b": (60.0, 2.0)}
    near = [
        score_candidates(base, ft, {"c": {"a": (50.0, 2.0), "b": (50.0 + e, 2.0)}}, margin=5.0)
        for e in (0, 1e-4)
    ]
    at, off = (d["candidates"][0]["hm_stderr"] for d in near)
    assert at == pytest.approx(off, rel=1e-3)


def _lm_eval_dir(tmp_path, name: str, samples: bytes):
    import json

    stamp = "2026-12-07T10-00-00.000001"
    d = tmp_path / name / "model"
    d.mkdir(parents=True)
    (d / f"results_{stamp}.json").write_text(json.dumps({"results": {"t": {"acc,none": 0.5}}}))
    (d / f"samples_t_{stamp}.jsonl").write_bytes(samples)
    return tmp_path / name


@pytest.mark.parametrize(
    ("samples", "why"),
    [
        (
            b'{"doc_id": 0, "filter": "none", "acc": [1, 0]}\n{"doc_id": 1, "filter": "none", "acc": [0, 0]}\n',
            "not one number per item",
        ),  # fmt: skip
        (b'{"doc_id": 0, "filter": "none", "acc": 1}\n{"doc_id": 1, "filter": "no', "not JSON"),  # truncated
        (b"[" * 200_000 + b"\n", "not JSON"),  # deeper than the parser goes
        (
            b'{"doc_id": 0, "filter": "none", "acc": 1}\n{"doc_id": 5, "filter": "none", "acc": 0}\n',
            "doc_ids",
        ),
    ],
)
def test_samples_that_cannot_pair_are_a_warning_never_a_refusal(tmp_path, samples, why):
    from dghard_cli.scoring.results import read_results

    rf = read_results(_lm_eval_dir(tmp_path, "o", samples))
    assert rf.scores["t"].value == 50.0 and rf.scores["t"].items is None
    assert any(why in w and "not paired" in w for w in rf.warnings), rf.warnings


def test_a_prompt_with_a_line_separator_is_one_line(tmp_path):
    """lm-eval writes samples with ensure_ascii=False: U+2028 inside a prompt is raw, and
    str.splitlines() split the record there."""
    import json

    from dghard_cli.scoring.results import read_results

    recs = [
        {"doc_id": i, "filter": "none", "doc": {"q": "a\u2028b\u0085c"}, "acc": float(i % 2)}
        for i in range(4)
    ]
    data = "\n".join(json.dumps(r, ensure_ascii=False) for r in recs).encode()
    rf = read_results(_lm_eval_dir(tmp_path, "o", data))
    assert rf.scores["t"].items == (0.0, 100.0, 0.0, 100.0), rf.warnings
