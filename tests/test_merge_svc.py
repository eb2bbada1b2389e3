"""SVC (``--calibrate svc``) after task arithmetic and TIES, with and without ``--lines``, against a
float64 numpy reference written here from the paper's formula, on generated sharded checkpoints;
the degenerate inputs (identical fine-tunes: the over-accumulation undone exactly; Δ = 0: BASE
bit for bit) and the options' refusals."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import load_dir, run_dghard
from test_merge_spectral import CFG, UBF16, as64, assert_close, is_matrix, run, three

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


def test_a_matrix_that_cannot_fit_is_refused_before_anything_is_written(tmp_path, models, monkeypatch):
    import dghard_cli.engine.working_memory as wm

    monkeypatch.setattr(wm, "machine_memory", lambda device=None: 8 * 160 * 48)
    with pytest.raises(Exception) as e:
        run(models["base"], models["fts"], tmp_path / "o", "task-arithmetic", calibrate="svc")
    msg = str(e.value)
    want = "for --calibrate svc (each merged matrix held in float64, with its Gram matrices)"
    assert want in msg and "model.embed_tokens.weight" in msg and len(msg.splitlines()) == 1, msg
    assert not (tmp_path / "o").exists()


def test_the_gram_route_holds_no_task_vector_whole(tmp_path, models, monkeypatch):
    """The calibration streams the task vectors in row blocks (M × M Gram matrices), so a machine
    with room for the merged matrix but not for a dense SVD's 8 copies runs it, with no SVD at all
    (it took the thin SVD of the whole merged update, and held 8 float64 copies of the matrix)."""
    import dghard_cli.engine.working_memory as wm
    import dghard_cli.methods.svc as svc

    b, fs = models["B"], models["F"]
    limit = max(svc.svc_bytes(*v.shape, 3) for v in b.values() if is_matrix(v))
    assert limit < svc.svc_dense_bytes(*b["model.embed_tokens.weight"].shape, 3)
    monkeypatch.setattr(wm, "machine_memory", lambda device=None: limit)
    monkeypatch.setattr(svc, "svd64", lambda x: pytest.fail("a dense SVD on the Gram route"))
    doc, got = run(models["base"], models["fts"], tmp_path / "o", "task-arithmetic", lam=0.5, calibrate="svc")
    merged = {k: v + 0.5 * sum(f[k] - v for f in fs) for k, v in b.items()}
    assert_close(got, calibrated(b, merged, fs), b)
    records = [r["svc"] for r in doc["tensors"] if "svc" in r]
    assert records and all(r["route"] == "gram-eigh-float64" and r["error_bound"] <= 1e-9 for r in records)
    assert "accurate_route_matrices" not in doc["svc"] and doc["svc"]["error_bound_max"] <= 1e-9


# -- the Gram route's bound, and the accurate route where it is too loose ---------------------------


def _tall(d: torch.Tensor) -> torch.Tensor:
    return d if d.shape[0] >= d.shape[1] else d.T


def _gram_route(dm: torch.Tensor, ds: list[torch.Tensor], alpha: float):
    from dghard_cli.methods.svc import gram_calibration

    xm, xs = _tall(dm), [_tall(d) for d in ds]
    tall = dm.shape[0] >= dm.shape[1]
    cal = gram_calibration(
        xm.T @ xm,
        [xm.T @ x for x in xs],
        None if tall else [x.T @ x for x in xs],
        [float(torch.linalg.vector_norm(x)) for x in xs],
        alpha,
        2.0**-24,
        xm.shape[0],
    )
    out = xm + xm @ cal.kernel
    return (out if tall else out.T), cal


def test_the_gram_route_is_within_its_bound_of_the_dense_svd():
    """Random merged updates of both orientations: full rank, signal + noise at 10⁻¹–10⁻⁸, exactly
    low rank, a flat spectrum (Iso-C's), half the spectrum within 10⁻⁹ of the top (one cluster or
    nearly), strengths 0.1–1 and α 0.1, 0.3, 1. The streamed result is within its recorded bound
    of the paper's formula on the thin SVD (spectral norm, relative to σ_max); the bound is below
    float32's resolution where the problem is well posed, and above it for a merged update with
    directions at the route's floor or a task with no component along a top direction."""
    from dghard_cli.methods.svc import calibrate

    tight = 0
    for trial in range(200):
        g = torch.Generator().manual_seed(trial)
        m, n = (int(torch.randint(2, 60, (1,), generator=g)) for _ in range(2))
        t, kind = int(torch.randint(2, 5, (1,), generator=g)), trial % 5
        ds = []
        for _ in range(t):
            r = int(torch.randint(1, min(m, n) + 1, (1,), generator=g))
            d = torch.randn(m, r, generator=g, dtype=torch.float64) @ torch.randn(
                r, n, generator=g, dtype=torch.float64
            )
            if kind in (1, 3):
                noise = 10.0 ** -float(torch.randint(1, 9, (1,), generator=g))
                d += noise * torch.randn(m, n, generator=g, dtype=torch.float64)
            ds.append(d * 10.0 ** float(torch.randn(1, generator=g)))
        dm = sum(ds)
        if kind == 2:  # flat
            u, _, vh = torch.linalg.svd(dm, full_matrices=False)
            dm = 0.5 * u @ vh
        elif kind == 4:  # half the spectrum nearly repeated
            u, s, vh = torch.linalg.svd(dm, full_matrices=False)
            k = max(1, len(s) // 2)
            s[:k] = s[0] * (1 + 1e-9 * torch.arange(k, dtype=torch.float64))
            dm = (u * s) @ vh
        else:
            dm = float(torch.rand(1, generator=g)) * dm
        alpha = (0.1, 0.3, 1.0)[trial % 3]
        want = calibrate(dm, iter(ds), alpha)[0]
        got, cal = _gram_route(dm, ds, alpha)
        s1 = float(torch.linalg.matrix_norm(dm, ord=2))
        err = float(torch.linalg.matrix_norm(got - want, ord=2)) / s1
        assert err <= cal.bound, (trial, kind, (m, n), err, cal.bound)
        full_rank = cal.rank == min(m, n)
        if kind == 0 and full_rank:
            tight += cal.bound <= 2.0**-24
    assert tight >= 20
    # a task with no component along the merge's top direction: s is 0/0 there, decided by
    # rounding on both routes, so the bound says the Gram route cannot be trusted
    g = torch.Generator().manual_seed(7)
    ds = [torch.randn(40, 30, generator=g, dtype=torch.float64) for _ in range(3)]
    dm = 0.4 * sum(ds)
    u = torch.linalg.svd(dm, full_matrices=False)[0][:, :1]
    ds[0] = ds[0] - u @ (u.T @ ds[0])
    assert _gram_route(dm, ds, 0.1)[1].bound > 2.0**-8
    # exactly rank 3 of 30: directions at the floor, γ unknown there
    ds = [
        torch.randn(40, 1, generator=g, dtype=torch.float64)
        @ torch.randn(1, 30, generator=g, dtype=torch.float64)
        for _ in range(3)
    ]
    cal = _gram_route(sum(ds), ds, 0.1)[1]
    assert cal.rank == 3 and 2.0**-24 < cal.bound < 2.0**-8


def test_a_gap_at_the_cluster_threshold_is_not_trusted_to_the_gram_route():
    """Two singular values 1 ulp further apart than the float32 output's cluster threshold
    (ε·σ_max/2⁻²⁴), exact in float64: the dense route gives each its own γ (0.94 and 5.33), the
    Gram route's eigenvalues, known to their rounding only, put them in one cluster (7.08 both),
    1.5·σ_max away. The bound was 2.3e-13 and the Gram route was taken; the decision lies within
    the rounding, so the bound is infinite now and the matrix takes the dense route."""
    from scipy.linalg import hadamard

    from dghard_cli.methods.svc import calibrate

    g = torch.Generator().manual_seed(1)
    u = torch.tensor(hadamard(64), dtype=torch.float64)[:, torch.randperm(64, generator=g)[:16]] / 8
    v = torch.tensor(hadamard(16), dtype=torch.float64)[:, torch.randperm(16, generator=g)[:16]] / 4
    gap = 2.0**-28 + 2.0**-52
    s = torch.tensor(
        [1.0, 0.25, 0.25 - gap] + [0.75 * 2.0 ** -(j + 3) for j in range(13)], dtype=torch.float64
    )
    t1, t2 = torch.ones(16, dtype=torch.float64), torch.ones(16, dtype=torch.float64)
    t1[1:3], t2[1:3] = torch.tensor([2.0, 1.0]), torch.tensor([0.125, 2.0])
    dm, ds = (u * s) @ v.T, [(u * t1) @ v.T, (u * t2) @ v.T]
    gamma = calibrate(dm, iter(ds), 0.1)[1]
    assert abs(float(gamma[1]) - float(gamma[2])) > 1.0  # two clusters on the dense route
    assert _gram_route(dm, ds, 0.1)[1].bound > 2.0**-24


def test_a_fine_tune_that_left_a_matrix_unchanged_keeps_it_on_the_gram_route(tmp_path, models):
    """A zero task vector has s = 0 exactly on both routes. Its 0/0 made the bound infinite-like
    (2.4), so every matrix of a merge with an untouched module (a frozen embedding, an adapter on
    other modules) took the dense SVD, or was refused where it could not fit."""
    b, fs = models["B"], models["F"]
    fts = [models["fts"][0], models["fts"][1], models["base"]]
    doc, got = run(models["base"], fts, tmp_path / "o", "task-arithmetic", lam=0.5, calibrate="svc")
    three_fs = [fs[0], fs[1], b]
    merged = {k: v + 0.5 * sum(f[k] - v for f in three_fs) for k, v in b.items()}
    assert_close(got, calibrated(b, merged, three_fs), b)
    records = [r["svc"] for r in doc["tensors"] if "svc" in r]
    assert records and all(r["route"] == "gram-eigh-float64" and r["error_bound"] < 1e-9 for r in records)


@pytest.fixture(scope="module")
def low_rank(tmp_path_factory):
    """A float64 BASE and three fine-tunes whose every matrix differs from it by rank 2 exactly."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("svc_low_rank")

    def rewrite(d, change):
        for f in sorted(d.glob("*.safetensors")):
            save_file({k: change(v) for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
        index = d / "model.safetensors.index.json"
        if index.exists():
            doc = json.loads(index.read_text())
            doc["metadata"]["total_size"] = sum(
                t.numel() * 8 for f in d.glob("*.safetensors") for t in load_file(f).values()
            )
            index.write_text(json.dumps(doc))

    base = root / "base"
    shutil.copytree(three(root / "b", CFG)[0], base)
    rewrite(base, lambda t: t.to(torch.float64))
    fts = []
    for k in range(3):
        d = root / f"lr{k}"
        shutil.copytree(base, d)
        g = torch.Generator().manual_seed(100 + k)

        def add_rank_2(t, g=g):
            if t.ndim != 2:
                return t
            a = torch.randn(t.shape[0], 2, generator=g, dtype=torch.float64)
            return t + 1e-2 * a @ torch.randn(2, t.shape[1], generator=g, dtype=torch.float64)

        rewrite(d, add_rank_2)
        fts.append(d)
    return {"base": base, "fts": fts, "B": as64(load_dir(base)), "F": [as64(load_dir(f)) for f in fts]}


def test_a_rank_deficient_merge_takes_the_accurate_route_for_a_float32_output(tmp_path, low_rank):
    """Rank 6 of 48: the directions at the Gram route's floor could hold up to 2·10⁻⁶·σ_max, and
    their γ is unknown there, too coarse for float32; the matrices are calibrated by the dense
    SVD, and the records say so. A bf16 output is within the Gram route's bound."""
    b, fs = low_rank["B"], low_rank["F"]
    merged = {k: v + 0.5 * sum(f[k] - v for f in fs) for k, v in b.items()}
    ref = calibrated(b, merged, fs)
    doc, got = run(
        low_rank["base"],
        low_rank["fts"],
        tmp_path / "f",
        "task-arithmetic",
        lam=0.5,
        calibrate="svc",
        policy=_policy(out_dtype="F32"),
    )
    assert_close(got, ref, b)
    records = [r["svc"] for r in doc["tensors"] if "svc" in r]
    assert records and all(r["route"] == "svd-float64" and r["gram_error_bound"] > 2.0**-24 for r in records)
    assert doc["svc"]["accurate_route_matrices"] == len(records) == doc["svc"]["calibrated_matrices"]
    doc, got = run(
        low_rank["base"],
        low_rank["fts"],
        tmp_path / "h",
        "task-arithmetic",
        lam=0.5,
        calibrate="svc",
        policy=_policy(out_dtype="BF16"),
    )
    assert_close(got, ref, b, unit=UBF16)
    records = [r["svc"] for r in doc["tensors"] if "svc" in r]
    assert all(
        r["route"] == "gram-eigh-float64" and r["rank"] == 6 and r["error_bound"] < 2.0**-8 for r in records
    )
    assert "accurate_route_matrices" not in doc["svc"]


def test_an_accurate_route_that_cannot_fit_is_refused_naming_the_tensor(tmp_path, low_rank, monkeypatch):
    import dghard_cli.engine.working_memory as wm
    import dghard_cli.methods.svc as svc

    limit = max(svc.svc_bytes(*v.shape, 3) for v in low_rank["B"].values() if is_matrix(v))
    assert limit < svc.svc_dense_bytes(160, 48, 3)
    monkeypatch.setattr(wm, "machine_memory", lambda device=None: limit)
    with pytest.raises(Exception) as e:
        run(
            low_rank["base"],
            low_rank["fts"],
            tmp_path / "o",
            "task-arithmetic",
            calibrate="svc",
            policy=_policy(out_dtype="F32"),
        )
    msg = str(e.value)
    assert "the accurate SVD route needs about" in msg and "--dtype bf16" in msg, msg
    assert msg.startswith("tensor '") and len(msg.splitlines()) == 1, msg
    assert not (tmp_path / "o").exists()


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
