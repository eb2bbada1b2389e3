"""SVC (``--calibrate svc``) after task arithmetic and TIES, with and without ``--lines``, against a
float64 numpy reference written here from the paper's formula, on generated sharded checkpoints;
the degenerate inputs (identical fine-tunes: the over-accumulation undone exactly; Δ = 0: BASE
bit for bit) and the options' refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import load_dir, run_dghard
from test_merge_spectral import CFG, as64, assert_close, is_matrix, run, three

from dghard_cli.schedule.spec import LayerSchedule

# -- the reference (the paper's formula, float64, full SVDs) ---------------------------------------


def ref_svc(b: np.ndarray, merged: np.ndarray, fs: list[np.ndarray], alpha: float = 0.1) -> np.ndarray:
    """W_base + U·diag(γ·σ)·Vᵀ of ΔW_m = merged − b, γ_r = T / Σ_i max(α, ⟨σ_r v_r, u_rᵀΔ_i⟩/‖u_rᵀΔ_i‖²);
    singular values within ε·σ_max/2⁻²⁴ of each other (a flat spectrum) share one γ, from the
    sums of those numerators and denominators over the cluster (independent of its basis)."""
    u, s, vt = np.linalg.svd(merged - b, full_matrices=False)
    c = np.concatenate([[0], np.cumsum(s[:-1] - s[1:] > 2.0**-52 * s[0] / 2.0**-24)]).astype(int)
    total = np.zeros(c[-1] + 1)
    for f in fs:
        a = u.T @ (f - b)
        den = np.bincount(c, (a * a).sum(axis=1))
        num = np.bincount(c, s * (a * vt).sum(axis=1))
        total += np.maximum(alpha, np.divide(num, den, out=np.zeros_like(num), where=den > 0))
    return b + (u * (len(fs) / total[c] * s)) @ vt


def calibrated(base: dict, merged: dict, fts: list[dict], alpha: float = 0.1) -> dict:
    """Every tensor: SVC on the matrices, the merge's value elsewhere."""
    return {
        k: ref_svc(b, merged[k], [f[k] for f in fts], alpha) if is_matrix(b) else merged[k]
        for k, b in base.items()
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("svc")
    base, fts = three(root, CFG)
    return {"base": base, "fts": fts, "B": as64(load_dir(base)), "F": [as64(load_dir(f)) for f in fts]}


def test_task_arithmetic_then_svc_matches_the_reference(tmp_path, models):
    b, fs = models["B"], models["F"]
    doc, got = run(models["base"], models["fts"], tmp_path / "o", "task-arithmetic", lam=0.5, calibrate="svc")
    merged = {k: v + 0.5 * sum(f[k] - v for f in fs) for k, v in b.items()}
    assert_close(got, calibrated(b, merged, fs), b)
    assert doc["parameters"]["calibrate"] == "svc" and "svc_alpha" not in doc["parameters"]
    assert doc["svc"]["alpha"] == 0.1 and doc["svc"]["calibrated_matrices"] == 2 + 2 * 7
    assert 0 < doc["svc"]["gamma_min"] <= doc["svc"]["gamma_max"] <= 1 / 0.1
    # nearly orthogonal task vectors at λ 0.5: along each task's own directions the merge holds
    # half of it (s ≈ 0.5 for that task, below α for the others), so SVC scales them up (γ > 1)
    q = next(r for r in doc["tensors"] if r["name"] == "model.layers.0.self_attn.q_proj.weight")
    assert q["svc"]["gamma_max"] > 1.0


def test_ties_then_svc_calibrates_the_ties_merge(tmp_path, models):
    """The calibration takes the merge as it is: TIES written in float64, then the formula."""
    b, fs = models["B"], models["F"]
    _, ties64 = run(
        models["base"], models["fts"], tmp_path / "t", "ties", density=0.5, policy=_policy(out_dtype="F64")
    )
    _, got = run(
        models["base"], models["fts"], tmp_path / "o", "ties", density=0.5, calibrate="svc", svc_alpha=0.3
    )
    assert_close(got, calibrated(b, as64(ties64), fs, alpha=0.3), b)


def test_svc_comes_before_the_layer_schedule(tmp_path, models):
    """--lines 0.5,0.5: layer 0's matrices get λ 0.5, layer 1's (the last) λ 1.0, of ΔW_svc."""
    b, fs = models["B"], models["F"]
    _, got = run(
        models["base"],
        models["fts"],
        tmp_path / "o",
        "task-arithmetic",
        lam=0.5,
        calibrate="svc",
        schedule=LayerSchedule(0.5, 0.5),
    )
    merged = {k: v + 0.5 * sum(f[k] - v for f in fs) for k, v in b.items()}
    ref = calibrated(b, merged, fs)
    for name, lam in (("model.layers.0.mlp.up_proj.weight", 0.5), ("model.layers.1.mlp.up_proj.weight", 1.0)):
        assert_close({name: got[name]}, {name: b[name] + lam * (ref[name] - b[name])}, {name: b[name]})


def test_identical_fine_tunes_undo_the_over_accumulation_exactly(tmp_path, models):
    """Task arithmetic of Δ twice gives 2Δ; every s_r is 2, γ_r = 2/(2 + 2) = ½: W = W_base + Δ."""
    fts = [models["fts"][0], models["fts"][0]]
    _, got = run(models["base"], fts, tmp_path / "o", "task-arithmetic", calibrate="svc")
    want = {
        k: models["F"][0][k] if is_matrix(v) else v + 2 * (models["F"][0][k] - v)
        for k, v in models["B"].items()
    }
    assert_close(got, want, models["B"])


def test_zero_deltas_give_base_exactly(tmp_path, models):
    _, got = run(models["base"], [models["base"], models["base"]], tmp_path / "o", "ties", calibrate="svc")
    base = load_dir(models["base"])
    assert all(torch.equal(got[k], base[k]) for k in base)


def test_the_recipe_key(tmp_path, models):
    rec = tmp_path / "recipe.yaml"
    rec.write_text(
        f"method: task-arithmetic\nbase: {models['base']}\nmodels:\n"
        + "".join(f"  - {f}\n" for f in models["fts"])
        + "lambda: 0.5\ncalibrate: svc\nsvc_alpha: 0.2\n"
    )
    res = run_dghard("merge", "--config", rec, "--out", tmp_path / "o")
    assert res.returncode == 0, res.stderr
    b, fs = models["B"], models["F"]
    merged = {k: v + 0.5 * sum(f[k] - v for f in fs) for k, v in b.items()}
    assert_close(load_dir(tmp_path / "o"), calibrated(b, merged, fs, alpha=0.2), b)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--svc-alpha", "0.2"], "--svc-alpha sets SVC's floor: it applies with --calibrate svc"),
        (["--calibrate", "svd"], "--calibrate must be svc"),
        (["--calibrate", "svc", "--svc-alpha", "0"], "--svc-alpha must be > 0"),
        (["--calibrate", "svc", "--svc-alpha", "inf"], "--svc-alpha must be a finite number"),
        (["--calibrate", "svc", "--format", "peft", "--rank", "4"], "--calibrate svc rescales"),
        (["--calibrate", "svc", "ONE"], "with one fine-tune it would undo the merge's strength"),
    ],
)
def test_bad_options_are_one_line_refusals(tmp_path, models, args, message):
    """Among them: SVC with one fine-tune (s_r is the merge's own strength, and γ = 1/max(α, s)
    gave back the fine-tune itself: wise-ft α 0.3 with --calibrate svc wrote FT, silently)."""
    fts = models["fts"][:1] if "ONE" in args else models["fts"]
    args = [a for a in args if a != "ONE"]
    res = run_dghard("merge", "--method", "ties", *args, models["base"], *fts, "--out", tmp_path / "o")
    assert res.returncode == 2 and message in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert not (tmp_path / "o").exists()


def _policy(**kw):
    from dghard_cli.engine.plan import PolicyOptions

    return PolicyOptions(**kw)


def test_a_matrix_whose_svd_cannot_fit_is_refused_before_anything_is_written(tmp_path, models, monkeypatch):
    import dghard_cli.engine.working_memory as wm

    monkeypatch.setattr(wm, "machine_memory", lambda device=None: 7 * 8 * 48 * 48)
    with pytest.raises(Exception) as e:
        run(models["base"], models["fts"], tmp_path / "o", "task-arithmetic", calibrate="svc")
    msg = str(e.value)
    want = "for --calibrate svc (a float64 SVD of each merged update, one task vector at a time)"
    assert want in msg and len(msg.splitlines()) == 1, msg
    assert not (tmp_path / "o").exists()


def test_svc_holds_one_task_vector_at_a_time(tmp_path, models, monkeypatch):
    """The calibration makes each task vector when it reaches it: its working set (8 float64
    copies of the matrix) does not grow with the number of fine-tunes. It held all T task
    vectors at once, (2T + 6) copies, and was refused on a machine where it fits now (the
    output, the same bytes, does not depend on it)."""
    import inspect

    import dghard_cli.engine.working_memory as wm
    import dghard_cli.methods.svc as svc

    whole, _ = run(models["base"], models["fts"], tmp_path / "a", "task-arithmetic", calibrate="svc")
    largest = max(r["shape"][0] * r["shape"][1] for r in whole["tensors"] if "svc" in r)
    monkeypatch.setattr(wm, "machine_memory", lambda device=None: 9 * 8 * largest)
    kinds = []
    real = svc.calibrate

    def seen(delta_m, deltas, alpha, unit=2.0**-24):
        kinds.append(inspect.isgenerator(deltas))  # made one at a time as calibrate reaches them
        return real(delta_m, deltas, alpha, unit)

    monkeypatch.setattr(svc, "calibrate", seen)
    run(models["base"], models["fts"], tmp_path / "b", "task-arithmetic", calibrate="svc")
    assert kinds and all(kinds) and len(models["fts"]) >= 2
    for f in sorted(p.name for p in (tmp_path / "a").glob("*.safetensors")):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()


def test_svc_after_iso_c_calibrates_its_flat_spectrum_as_one_cluster(tmp_path, models):
    """Iso-C's merged update has one singular value σ̄ repeated: its singular directions are any
    basis of that span, and the paper's per-direction γ would depend on LAPACK's choice (and on
    a 576 × 1536 real matrix LAPACK's divide-and-conquer SVD failed to converge on it: "internal
    error", exit 3). The repeated values share one γ, the same for every basis."""
    b, fs = models["B"], models["F"]
    _, iso64 = run(models["base"], models["fts"], tmp_path / "i", "iso-c", policy=_policy(out_dtype="F64"))
    doc, got = run(models["base"], models["fts"], tmp_path / "o", "iso-c", calibrate="svc")
    assert_close(got, calibrated(b, as64(iso64), fs), b)
    q = next(r for r in doc["tensors"] if r["name"] == "model.layers.0.self_attn.q_proj.weight")
    assert q["svc"]["gamma_min"] == q["svc"]["gamma_max"]  # one cluster: one γ


def test_the_svd_falls_back_where_lapack_does_not_converge(monkeypatch):
    from dghard_cli.methods import subspace_svd

    g = torch.Generator().manual_seed(1)
    x = torch.randn((30, 12), generator=g, dtype=torch.float64)
    real = torch.linalg.svd
    calls: list = []
    state = {"fail": 0}

    def failing(a, full_matrices=True):
        calls.append(a.shape)
        if len(calls) <= state["fail"]:
            raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge")
        return real(a, full_matrices=full_matrices)

    for fail in (1, 2):  # the transpose, then the Gram matrix's eigendecomposition
        state["fail"] = fail
        calls.clear()
        monkeypatch.setattr(torch.linalg, "svd", failing)
        u, s, vh = subspace_svd.svd64(x)
        monkeypatch.setattr(torch.linalg, "svd", real)
        assert u.shape == (30, 12) and vh.shape == (12, 12)
        assert torch.allclose((u * s) @ vh, x, atol=1e-12)
        assert torch.allclose(u.T @ u, torch.eye(12, dtype=torch.float64), atol=1e-10)
        assert torch.all(s[:-1] >= s[1:])
