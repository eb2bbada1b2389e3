"""scripts/real_model_check.py's comparisons, on tiny checkpoints made here (the check itself runs on
the real model in .ci/run): the repair is compared with its float64 reference on every matrix, and
an output that returned one of its inputs unchanged fails in one line naming the tensor. The known
answers cannot catch that: BASE, the fine-tunes and any correct output all give them."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import real_model_check as check
from reference import ref_filter
from safetensors.numpy import save_file

MATRICES = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.1.mlp.up_proj.weight",
    "model.layers.2.mlp.down_proj.weight",
]
NORMS = ["model.layers.0.input_layernorm.weight", "model.norm.weight"]


def _save(d: Path, tensors: dict[str, np.ndarray]) -> check.Weights:
    d.mkdir()
    save_file(
        {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}, d / "model.safetensors"
    )
    return check.Weights(d)


def _base(rng) -> dict[str, np.ndarray]:
    t = {name: rng.standard_normal((48, 32)).astype(np.float32) for name in MATRICES}
    t.update({name: np.ones(32, np.float32) for name in NORMS})
    return t


def _fine_tune(rng, base: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """BASE plus a rank-3 update and a little noise in every tensor (every parameter trained)."""
    out = {}
    for name, b in base.items():
        if b.ndim == 2:
            signal = rng.standard_normal((b.shape[0], 3)) @ rng.standard_normal((3, b.shape[1]))
            out[name] = (b + 0.05 * signal + 0.01 * rng.standard_normal(b.shape)).astype(np.float32)
        else:
            out[name] = (b + 0.01 * rng.standard_normal(b.shape)).astype(np.float32)
    return out


@pytest.fixture
def ckpts(tmp_path):
    rng = np.random.default_rng(0)
    base = _base(rng)
    ft1, ft2 = _fine_tune(rng, base), _fine_tune(rng, base)
    return tmp_path, base, ft1, ft2


def _repair(base: dict, ft: dict) -> tuple[dict, dict]:
    """The correct repair (float64 reference, rounded to float32) and its report."""
    out, records = {}, []
    for name, f in ft.items():
        if f.ndim != 2:
            out[name] = f
            records.append({"name": name, "action": "kept-ft"})
            continue
        b = base[name].astype(np.float64)
        ref, rank, _ = ref_filter(f.astype(np.float64) - b)
        out[name] = b + ref
        records.append({"name": name, "action": "method", "rank_kept": rank})
    return out, {"tensors": records}


def test_repair_is_compared_on_every_matrix(ckpts):
    """Before: the check compared 3 named matrices; a wrong one elsewhere passed."""
    tmp, base, ft1, _ = ckpts
    good, report = _repair(base, ft1)
    wb, wf = _save(tmp / "base", base), _save(tmp / "ft", ft1)
    counts = check.check_repair(wb, wf, _save(tmp / "good", good), report)
    assert counts == {"matrices": len(MATRICES), "below_full": len(MATRICES), "differ_from_ft": len(MATRICES)}
    assert all(r["rank_kept"] < 32 for r in report["tensors"] if "rank_kept" in r)

    bad = dict(good)
    name = "model.layers.1.mlp.up_proj.weight"  # not one of the three the check used to compare
    bad[name] = good[name] + 1e-3
    with pytest.raises(check.CheckFailed, match=rf"^{name}: \d+ values differ from the float64 reference"):
        check.check_repair(wb, wf, _save(tmp / "bad", bad), report)


def test_repair_that_returned_the_fine_tune_fails_naming_the_tensor(ckpts):
    tmp, base, ft1, _ = ckpts
    _, report = _repair(base, ft1)
    wb, wf = _save(tmp / "base", base), _save(tmp / "ft", ft1)
    with pytest.raises(check.CheckFailed) as e:
        check.check_repair(wb, wf, _save(tmp / "out", ft1), report)
    assert str(e.value) == (
        "repair model.embed_tokens.weight: equals FT bit for bit, where it must differ from it"
    )


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("model.layers.2.mlp.down_proj.weight", "equals BASE bit"),  # a matrix that returned the base
        ("model.norm.weight", "not a matrix, yet it differs from FT's$"),  # norms must be the fine-tune's
    ],
)
def test_repair_output_replaced_by_the_base_fails_naming_the_tensor(ckpts, name, message):
    tmp, base, ft1, _ = ckpts
    good, report = _repair(base, ft1)
    out = {**good, name: base[name]}
    with pytest.raises(check.CheckFailed, match=f"^repair {re.escape(name)}: {message}"):
        check.check_repair(_save(tmp / "base", base), _save(tmp / "ft", ft1), _save(tmp / "out", out), report)


def test_repair_rank_is_checked_on_every_matrix(ckpts):
    tmp, base, ft1, _ = ckpts
    good, report = _repair(base, ft1)
    rec = next(r for r in report["tensors"] if r["name"] == "model.layers.1.mlp.up_proj.weight")
    rec["rank_kept"] += 1
    with pytest.raises(
        check.CheckFailed, match=r"^repair model.layers.1.mlp.up_proj.weight: kept rank \d+, the float64"
    ):
        check.check_repair(
            _save(tmp / "base", base), _save(tmp / "ft", ft1), _save(tmp / "good", good), report
        )


def test_repair_of_a_matrix_whose_delta_the_cut_keeps_whole_may_equal_the_fine_tune(ckpts):
    """An untouched matrix (a zero delta: kept rank 0, below full) rightly equals FT and BASE."""
    tmp, base, ft1, _ = ckpts
    name = "model.layers.0.self_attn.q_proj.weight"
    ft1 = {**ft1, name: base[name]}
    good, report = _repair(base, ft1)
    assert next(r for r in report["tensors"] if r["name"] == name)["rank_kept"] == 0
    counts = check.check_repair(
        _save(tmp / "base", base), _save(tmp / "ft", ft1), _save(tmp / "good", good), report
    )
    assert counts["below_full"] == len(MATRICES) and counts["differ_from_ft"] == len(MATRICES) - 1


def _task_arithmetic(base, ft1, ft2, lam=0.5):
    out = {}
    for n, b in base.items():
        b = b.astype(np.float64)
        out[n] = b + lam * ((ft1[n] - b) + (ft2[n] - b))
    return out


def _ties(base, ft1, ft2, lines=check.LINES):
    out = {}
    for n, b in base.items():
        b = b.astype(np.float64)
        d = np.stack([ft1[n] - b, ft2[n] - b])
        sign = np.where(d.sum(0) >= 0, 1.0, -1.0)
        agree = (np.sign(d) == sign) & (d != 0)
        mean = (d * agree).sum(0) / np.maximum(agree.sum(0), 1)
        depth = int(n.split(".")[2]) / 2 if n.startswith("model.layers.") else (0.0 if "embed" in n else 1.0)
        out[n] = b + (lines[0] + lines[1] * depth) * mean
    return out


def test_merges_pass_and_must_differ_from_every_input(ckpts):
    tmp, base, ft1, ft2 = ckpts
    wb, w1, w2 = _save(tmp / "base", base), _save(tmp / "ft1", ft1), _save(tmp / "ft2", ft2)
    n = len(base)
    assert check.check_task_arithmetic(
        wb, w1, w2, _save(tmp / "ta", _task_arithmetic(base, ft1, ft2)), 0.5
    ) == (n, 3 * n)
    assert (
        check.check_ties_lines(wb, [w1, w2], _save(tmp / "ties", _ties(base, ft1, ft2)), check.LINES) == 3 * n
    )


@pytest.mark.parametrize("merge", ["task arithmetic", "ties --lines"])
@pytest.mark.parametrize("which", ["BASE", "FT1", "FT2"])
def test_merge_that_returned_an_input_fails_naming_the_tensor(ckpts, merge, which):
    """Before: the reference comparison failed too, but only as 'values differ', not saying the
    output was an input unchanged."""
    tmp, base, ft1, ft2 = ckpts
    name = "model.layers.1.mlp.up_proj.weight"
    good = _task_arithmetic(base, ft1, ft2) if merge == "task arithmetic" else _ties(base, ft1, ft2)
    out = {**good, name: {"BASE": base, "FT1": ft1, "FT2": ft2}[which][name]}
    wb, w1, w2 = _save(tmp / "base", base), _save(tmp / "ft1", ft1), _save(tmp / "ft2", ft2)
    wo = _save(tmp / "out", out)
    with pytest.raises(check.CheckFailed) as e:
        if merge == "task arithmetic":
            check.check_task_arithmetic(wb, w1, w2, wo, 0.5)
        else:
            check.check_ties_lines(wb, [w1, w2], wo, check.LINES)
    assert str(e.value) == f"{merge} {name}: equals {which} bit for bit, where it must differ from it"
