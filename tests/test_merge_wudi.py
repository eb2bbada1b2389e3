"""WUDI against a float64 numpy gradient-descent loop written here from the paper's objective
(nothing imported from the package's math): k plain gradient steps on
L(τ) = Σ_i ‖(τ − τ_i)·τ_iᵀ‖²_F / ‖τ_i‖²_F from Σ_i τ_i, step 1/(2·λ_max(A)). On generated sharded
checkpoints (three fine-tunes of one BASE; Llama names, square, tall and wide matrices, tied and
untied vocabularies); the degenerate inputs (one fine-tune, identical ones, Δ = 0, a zero task
vector); ``--lines``; the parameter's checks; the refusals before anything is written.

Tolerances as in test_merge_spectral: every entry within ``1e-6·max|Δ*|`` of the reference plus
the output dtype's rounding of the entry.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import load_dir, run_dghard
from test_merge_spectral import (
    _policy,
    as64,
    assert_close,
    is_matrix,
    model_set,
    odd_shapes,
    run,
)

from dghard_cli.engine.writer import RunOptions
from dghard_cli.errors import InputError
from dghard_cli.schedule.spec import LayerSchedule

# -- the reference: gradient descent on the objective ----------------------------------------------


def objective(tau: np.ndarray, taus: list[np.ndarray]) -> float:
    return sum(float(np.sum(((tau - t) @ t.T) ** 2) / np.sum(t**2)) for t in taus if np.sum(t**2) > 0)


def ref_wudi(b: np.ndarray, fs: list[np.ndarray], steps: int = 300, alpha: float = 1.0) -> np.ndarray:
    """α·(k gradient steps from the sum); a zero task vector is left out of the objective."""
    taus = [f - b for f in fs]
    live = [t for t in taus if np.sum(t**2) > 0]
    tau = np.sum(taus, axis=0)
    if not live:
        return alpha * tau
    a = sum(t.T @ t / np.sum(t**2) for t in live)
    step = 1.0 / (2.0 * np.linalg.eigvalsh(a)[-1])
    for _ in range(steps):
        grad = 2.0 * sum((tau - t) @ t.T @ t / np.sum(t**2) for t in live)
        tau = tau - step * grad
    return alpha * tau


def reference(base, fts, **kw):
    out = {}
    for name, b in base.items():
        fs = [f[name] for f in fts]
        if is_matrix(b):
            out[name] = b + ref_wudi(b, fs, **kw)
        else:  # α·the mean, as the reference code
            out[name] = b + kw.get("alpha", 1.0) * np.mean([f - b for f in fs], axis=0)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return model_set(tmp_path_factory.mktemp("wudi-merge"))


# -- against the reference ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw,ref_kw",
    [
        ({}, {}),
        ({"alpha": 0.7, "steps": 25}, {"alpha": 0.7, "steps": 25}),
        ({"steps": 1}, {"steps": 1}),
        ({"steps": 0}, {"steps": 0}),  # the sum of the task vectors: task arithmetic at λ 1
    ],
)
def test_wudi_matches_gradient_descent(tmp_path, models, kw, ref_kw):
    doc, got = run(models["base"], models["fts"], tmp_path / "o", "wudi", **kw)
    assert_close(got, reference(models["B"], models["F"], **ref_kw), models["B"])
    recs = {r["name"]: r for r in doc["tensors"]}
    for name in ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        r = recs[name]  # tall, then wide (48 × 100, T·m = 144: its 100 × 100 Gram, the row form)
        assert (
            r["merge_rule"] == "wudi" and r["route"] == "gram-float64" and r["steps"] == kw.get("steps", 300)
        )
        assert r["error_bound"] < 2.0**-24 and 0.0 < r["lambda_max"] <= 3.0
        assert 0.0 <= r["converged_share"] <= 1.0
    assert recs["model.norm.weight"]["merge_rule"] == "average"
    assert doc["merge"]["wudi_matrices"] == 2 + 2 * 7  # embeddings, head, 7 per layer
    assert doc["parameters"]["steps"] == kw.get("steps", 300) and doc["parameters"]["alpha"] == kw.get(
        "alpha", 1.0
    )


def test_the_descent_lowers_the_objective_towards_its_minimum(models):
    """More steps, lower interference (a check on the reference itself: the same objective)."""
    name = "model.layers.1.mlp.down_proj.weight"
    b, fs = models["B"][name], [f[name] for f in models["F"]]
    taus = [f - b for f in fs]
    values = [objective(ref_wudi(b, fs, steps=k), taus) for k in (0, 1, 25, 300)]
    assert all(x > y for x, y in zip(values, values[1:], strict=False)), values


def test_tied_embeddings_and_small_row_blocks(tmp_path, models):
    _, got = run(models["tbase"], models["tfts"], tmp_path / "o", "wudi", steps=40, block_bytes=8 * 48 * 5)
    assert "lm_head.weight" not in got
    assert_close(got, reference(models["TB"], models["TF"], steps=40), models["TB"])


def test_thin_matrices(tmp_path):
    """1×N: averaged; 2×N (wide, T·m = 6) and N×3 (tall): matrices."""
    base, fts = odd_shapes(tmp_path)
    _, got = run(base, fts, tmp_path / "o", "wudi", policy=_policy(min_numel=0))
    b, f = as64(load_dir(base)), [as64(load_dir(x)) for x in fts]
    assert_close(got, reference(b, f), b)


def test_a_wide_matrix_takes_the_smaller_of_its_two_forms(tmp_path, models, monkeypatch):
    """A wide m × n matrix is filtered through its n × n Gram (read in row blocks) when n ≤ T·m and
    through the T·m × T·m cross products otherwise: the eigensolver's cube of the smaller order
    (SmolLM2's 576 × 1536 ``down_proj`` with 4 fine-tunes: 1536 instead of 2304). Both forms
    equal the reference on the same matrices (the cross form forced on the row form's)."""
    from dghard_cli.methods import wudi

    assert wudi.row_form(576, 1536, 4) and wudi.gram_order(576, 1536, 4) == 1536
    assert not wudi.row_form(896, 4864, 3) and wudi.gram_order(896, 4864, 3) == 2688
    assert wudi.row_form(1536, 576, 1) and wudi.row_form(48, 100, 3) and not wudi.row_form(2, 300, 3)
    assert wudi.working_bytes(48, 100, 3) == 12 * 8 * 100 * 100
    # never a larger working set: 896 × 4864 with 6 fine-tunes (T·m = 5376) has 6 Gram matrices of
    # 4864² (2.84 GB) against one 5376² (2.50 GB): the cross form, as before
    assert not wudi.row_form(896, 4864, 6) and wudi.working_bytes(896, 4864, 6) < 15 * 8 * 4864**2
    ref = reference(models["B"], models["F"], steps=40)
    name = "model.layers.0.mlp.down_proj.weight"
    doc, got = run(
        models["base"], models["fts"], tmp_path / "rows", "wudi", steps=40, block_bytes=8 * 100 * 7
    )
    assert_close(got, ref, models["B"])
    bound = next(r["error_bound"] for r in doc["tensors"] if r["name"] == name)
    assert bound == pytest.approx(wudi.error_bound(100 + 48**0.5, 40), rel=1e-3)  # M + √N of the form taken
    monkeypatch.setattr(wudi, "row_form", lambda r, c, t: r >= c)
    doc, got = run(models["base"], models["fts"], tmp_path / "cross", "wudi", steps=40)
    assert_close(got, ref, models["B"])
    bound = next(r["error_bound"] for r in doc["tensors"] if r["name"] == name)
    assert bound == pytest.approx(wudi.error_bound(144 + 100**0.5, 40), rel=1e-3)


def test_layer_strengths_compose(tmp_path, models):
    doc, got = run(
        models["base"], models["fts"], tmp_path / "o", "wudi", steps=25, schedule=LayerSchedule(0.3, 0.6)
    )
    ref = reference(models["B"], models["F"], steps=25)
    recs = {r["name"]: r for r in doc["tensors"]}
    scaled = {n: models["B"][n] + recs[n]["layer_strength"] * (r - models["B"][n]) for n, r in ref.items()}
    assert_close(got, scaled, models["B"])


# -- degenerate inputs ----------------------------------------------------------------------------


def test_one_fine_tune_is_its_own_minimiser(tmp_path, models):
    _, got = run(models["base"], models["fts"][:1], tmp_path / "o", "wudi")
    assert_close(got, models["F"][0], models["B"])


def test_identical_fine_tunes(tmp_path, models):
    """Two equal task vectors: the descent moves from 2τ towards τ (the minimiser) in the
    directions it converges in."""
    fts = [models["fts"][0], models["fts"][0]]
    _, got = run(models["base"], fts, tmp_path / "o", "wudi", steps=30)
    assert_close(got, reference(models["B"], [models["F"][0]] * 2, steps=30), models["B"])


def test_zero_deltas_give_base_exactly(tmp_path, models):
    _, got = run(models["base"], [models["base"], models["base"]], tmp_path / "o", "wudi")
    base = load_dir(models["base"])
    assert all(torch.equal(got[k], base[k]) for k in base)


def test_a_zero_task_vector_is_left_out_of_the_objective(tmp_path, models):
    """The reference code divides 0 by 0 for it; here it adds nothing: WUDI of (FT, BASE) is the
    fine-tune on every matrix (the other tensors are averaged, as always)."""
    _, got = run(models["base"], [models["fts"][1], models["base"]], tmp_path / "o", "wudi", steps=20)
    ref = reference(models["B"], [models["F"][1], models["B"]], steps=20)
    assert_close(got, ref, models["B"])
    for k, r in ref.items():
        if is_matrix(r):
            assert np.abs(r - models["F"][1][k]).max() <= 1e-12 * np.abs(models["F"][1][k]).max()


# -- the surfaces and the refusals ----------------------------------------------------------------


def test_the_cli_flags_and_recipe_keys(tmp_path, models):
    res = run_dghard(
        "merge", "--method", "wudi", "--steps", "12", "--alpha", "0.9",
        models["base"], *models["fts"], "--out", tmp_path / "o",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert_close(
        load_dir(tmp_path / "o"), reference(models["B"], models["F"], steps=12, alpha=0.9), models["B"]
    )
    rec = tmp_path / "recipe.yaml"
    rec.write_text(
        f"method: wudi\nbase: {models['base']}\nmodels:\n"
        + "".join(f"  - {f}\n" for f in models["fts"])
        + "steps: 7\n"
    )
    res = run_dghard("merge", "--config", rec, "--out", tmp_path / "o2")
    assert res.returncode == 0, res.stderr
    assert_close(load_dir(tmp_path / "o2"), reference(models["B"], models["F"], steps=7), models["B"])
    rec.write_text(rec.read_text().replace("steps: 7", "steps: 2.5"))
    res = run_dghard("merge", "--config", rec, "--out", tmp_path / "o3")
    assert res.returncode == 2 and "key 'steps' must be an integer, got float 2.5" in res.stderr, res.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["--method", "wudi", "--steps", "-1"], "--steps must be a whole number in [0, 100000]"),
        (["--method", "wudi", "--steps", "100001"], "--steps must be a whole number in [0, 100000]"),
        (["--method", "wudi", "--alpha", "-1"], "--alpha must be in"),
        (["--method", "ties", "--steps", "40"], "--steps does not apply to --method ties"),
    ],
)
def test_bad_parameters_are_one_line_refusals(tmp_path, models, args, message):
    res = run_dghard("merge", *args, models["base"], *models["fts"], "--out", tmp_path / "o")
    assert res.returncode == 2 and message in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert not (tmp_path / "o").exists()


def test_an_error_bound_above_the_output_resolution_is_refused_before_writing(tmp_path, models):
    """10⁵ steps on a 48-column Gram: ε·48·(k + k²/2) ≈ 5e-5, above float32's 6e-8; bf16's 3.9e-3
    takes it."""
    with pytest.raises(InputError) as e:
        run(models["base"], models["fts"], tmp_path / "o", "wudi", steps=100_000)
    msg = str(e.value)
    assert "error bound" in msg and "give --steps" in msg and len(msg.splitlines()) == 1, msg
    assert not (tmp_path / "o").exists()
    top = int(msg.split("give --steps ")[1].split()[0])
    assert 100 < top < 100_000
    run(models["base"], models["fts"], tmp_path / "ok", "wudi", steps=top)  # the hint is accepted


def test_a_matrix_whose_grams_cannot_fit_is_refused_before_anything_is_written(tmp_path, models, monkeypatch):
    import dghard_cli.engine.working_memory as wm

    monkeypatch.setattr(wm, "machine_memory", lambda device=None: 4 * 8 * 48 * 48)
    with pytest.raises(InputError) as e:
        run(models["base"], models["fts"], tmp_path / "o", "wudi")
    msg = str(e.value)
    assert "float64 Gram matrices of the task vectors" in msg and "--method wudi" in msg
    assert len(msg.splitlines()) == 1 and not (tmp_path / "o").exists()


def test_nonfinite_inputs(tmp_path):
    """A NaN in a fine-tune's matrix: refused by name, or kept with --allow-nonfinite."""
    base, fts = odd_shapes(tmp_path)
    name = "model.layers.0.mlp.down_proj.weight"
    from dghard_cli.testing.synthetic import write_checkpoint

    bad = {k: v.clone() for k, v in load_dir(fts[0]).items()}
    bad[name][0, 0] = float("nan")
    write_checkpoint(tmp_path / "bad", list(bad.items()), config=None)
    with pytest.raises(InputError, match=name):
        run(base, [tmp_path / "bad", *fts[1:]], tmp_path / "o", "wudi", policy=_policy(min_numel=0))
    doc, _ = run(
        base,
        [tmp_path / "bad", *fts[1:]],
        tmp_path / "o2",
        "wudi",
        policy=_policy(min_numel=0),
        run=RunOptions(device="cpu", quiet=True, allow_nonfinite=True),
    )
    rec = next(r for r in doc["tensors"] if r["name"] == name)
    assert rec["action"] == "kept-ft" and rec["nonfinite"]


def test_the_kernels_do_not_depend_on_the_task_vectors_scale():
    """τ_k is homogeneous in the task vectors, so each kernel M_i is scale-free: float64 task
    vectors of 1e150 or 1e-80 (whose squared norms' products would overflow or go subnormal)
    give the kernels of scale 1."""
    from dghard_cli.methods.wudi import tall_kernels, wide_kernels

    g = torch.Generator().manual_seed(3)
    xs = [torch.randn((40, 6), generator=g, dtype=torch.float64) for _ in range(3)]
    for scale in (1e150, 1e-80):
        tall = tall_kernels([x.T @ x for x in xs], 25)[0]
        tall_s = tall_kernels([(scale * x).T @ (scale * x) for x in xs], 25)[0]
        cross = lambda ys: {(i, j): ys[i].T @ ys[j] for i in range(3) for j in range(i, 3)}  # noqa: E731
        wide = wide_kernels(cross(xs), 3, 25)[0]
        wide_s = wide_kernels(cross([scale * x for x in xs]), 3, 25)[0]
        for a, b in zip([*tall, *wide], [*tall_s, *wide_s], strict=True):
            assert torch.allclose(a, b, rtol=1e-10, atol=1e-12 * float(a.abs().max())), scale


def test_an_adapter_output_is_refused_for_full_fine_tunes(tmp_path, models):
    """WUDI keeps the sum of the task vectors where the descent does not reach: not low-rank."""
    res = run_dghard(
        "merge",
        "--method",
        "wudi",
        "--format",
        "peft",
        models["base"],
        *models["fts"],
        "--out",
        tmp_path / "o",
    )
    assert res.returncode == 2 and "not low-rank" in res.stderr and res.stderr.count("\n") == 1, res.stderr
