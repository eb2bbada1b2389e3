"""STAR and CART against float64 numpy references written here from the papers' formulas (full
``np.linalg.svd``, nothing imported from the package's math), on generated sharded checkpoints
(three fine-tunes of one BASE; Llama names, square, tall and wide matrices, tied and untied
vocabularies, 1×N tensors); the degenerate inputs (one fine-tune, identical fine-tunes, Δ = 0,
repeated singular values at the cut), each a finite documented result; the parameters' checks.

Tolerances as in test_merge_spectral: every entry within ``1e-6·max|Δ*|`` of the reference plus
the output dtype's rounding of the entry.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import f64, load_dir, run_dghard
from test_merge_spectral import (
    _policy,
    as64,
    assert_close,
    is_matrix,
    model_set,
    odd_shapes,
    run,
)

from dghard_cli.testing.synthetic import write_checkpoint

# -- references (the papers' formulas, float64, full SVDs) -----------------------------------------


def _svd(a: np.ndarray):
    u, s, vt = np.linalg.svd(a, full_matrices=False)
    r = int(np.count_nonzero(s > 1e-6 * s[0])) if s.size and s[0] > 0 else 0
    return u[:, :r], s[:r], vt[:r]


def ref_star(b, fs, alpha=1.0, eta=40.0):
    """α·mean_i of each Δ_i's top r_i triplets (σ's reaching η % of their sum), rescaled to keep
    the nuclear norm."""
    out = np.zeros_like(b)
    for f in fs:
        u, s, vt = _svd(f - b)
        if not s.size:
            continue
        r = int(np.argmax(np.cumsum(s) >= eta / 100 * s.sum())) + 1
        out += (u[:, :r] * (s[:r] * s.sum() / s[:r].sum())) @ vt[:r]
    return alpha * out / len(fs)


def ref_cart(b, fs, lam=2.0, ratio=0.12):
    """τ̄ + λ·Σ_i [Δ_i − τ̄]_k, k = max(1, ⌊ratio·min(m, n)⌋)."""
    deltas = [f - b for f in fs]
    mean = np.mean(deltas, axis=0)
    k = max(1, int(ratio * min(b.shape)))
    out = mean.copy()
    for d in deltas:
        u, s, vt = _svd(d - mean)
        out += lam * (u[:, :k] * s[:k]) @ vt[:k]
    return out


REFS = {"star": ref_star, "cart": ref_cart}


def reference(method, base, fts, **kw):
    out = {}
    for name, b in base.items():
        fs = [f[name] for f in fts]
        if is_matrix(b):
            out[name] = b + REFS[method](b, fs, **kw)
        else:  # STAR: α·the mean; CART: the mean (its centred parts sum to zero)
            scale = kw.get("alpha", 1.0) if method == "star" else 1.0
            out[name] = b + scale * np.mean([f - b for f in fs], axis=0)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return model_set(tmp_path_factory.mktemp("low-rank-merge"))


# -- the methods against their references ---------------------------------------------------------


@pytest.mark.parametrize(
    "method,kw,ref_kw",
    [
        ("star", {}, {}),
        ("star", {"alpha": 1.5, "eta": 70.0}, {"alpha": 1.5, "eta": 70.0}),
        ("cart", {}, {}),
        ("cart", {"lam": 0.8, "rank_ratio": 0.3}, {"lam": 0.8, "ratio": 0.3}),
    ],
)
def test_methods_match_the_float64_references(tmp_path, models, method, kw, ref_kw):
    doc, got = run(models["base"], models["fts"], tmp_path / "o", method, **kw)
    assert_close(got, reference(method, models["B"], models["F"], **ref_kw), models["B"])
    recs = {r["name"]: r for r in doc["tensors"]}
    q = recs["model.layers.0.self_attn.q_proj.weight"]
    # the streaming Gram route, its bound far below the float32 output's resolution
    assert q["merge_rule"] == method and q["route"] == "gram-eigh-float64" and q["error_bound"] < 1e-9
    assert recs["model.norm.weight"]["merge_rule"] == "average"
    assert doc["merge"]["low_rank_matrices"] == 2 + 2 * 7  # embeddings, head, 7 per layer
    if method == "cart":
        assert doc["parameters"]["lambda"] == kw.get("lam", 2.0)
        assert doc["parameters"]["rank_ratio"] == kw.get("rank_ratio", 0.12)
        assert q["rank_k"] == max(1, int(kw.get("rank_ratio", 0.12) * 48))
    else:
        assert doc["parameters"]["eta"] == kw.get("eta", 40.0) and doc["parameters"]["alpha"] == kw.get(
            "alpha", 1.0
        )
        assert all(1 <= r < 48 for r in q["task_ranks"])


@pytest.mark.parametrize("method", ["star", "cart"])
def test_tied_embeddings_and_small_row_blocks(tmp_path, models, method):
    _, got = run(models["tbase"], models["tfts"], tmp_path / "o", method, block_bytes=8 * 48 * 5)
    assert "lm_head.weight" not in got
    assert_close(got, reference(method, models["TB"], models["TF"]), models["TB"])


def test_the_cli_flags_and_recipe_keys(tmp_path, models):
    out = tmp_path / "o"
    res = run_dghard(
        "merge", "--method", "cart", "--lambda", "1.5", "--rank-ratio", "0.25",
        models["base"], *models["fts"], "--out", out, "--report", tmp_path / "r.json",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert_close(load_dir(out), reference("cart", models["B"], models["F"], lam=1.5, ratio=0.25), models["B"])
    rec = tmp_path / "recipe.yaml"
    rec.write_text(
        f"method: star\nbase: {models['base']}\nmodels:\n"
        + "".join(f"  - {f}\n" for f in models["fts"])
        + "eta: 60\nalpha: 0.5\n"
    )
    res = run_dghard("merge", "--config", rec, "--out", tmp_path / "o2")
    assert res.returncode == 0, res.stderr
    assert_close(
        load_dir(tmp_path / "o2"),
        reference("star", models["B"], models["F"], alpha=0.5, eta=60.0),
        models["B"],
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (["--method", "star", "--eta", "0"], "--eta must be in (0, 100]"),
        (["--method", "star", "--eta", "150"], "--eta must be in (0, 100]"),
        (["--method", "star", "--alpha", "-1"], "--alpha must be in"),
        (["--method", "cart", "--rank-ratio", "0"], "--rank-ratio must be in (0, 1]"),
        (["--method", "cart", "--rank-ratio", "nan"], "--rank-ratio must be a finite number"),
        (["--method", "ties", "--eta", "40"], "--eta"),
    ],
)
def test_bad_parameters_are_one_line_refusals(tmp_path, models, args, message):
    res = run_dghard("merge", *args, models["base"], *models["fts"], "--out", tmp_path / "o")
    assert res.returncode == 2 and message in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert not (tmp_path / "o").exists()


# -- degenerate inputs ----------------------------------------------------------------------------


def test_one_fine_tune(tmp_path, models):
    """CART: the centred part is zero, W = W_base + Δ (the fine-tune); STAR: α·STAR(Δ)."""
    _, got = run(models["base"], models["fts"][:1], tmp_path / "c", "cart")
    assert_close(got, {k: v for k, v in models["F"][0].items()}, models["B"])
    _, got = run(models["base"], models["fts"][:1], tmp_path / "s", "star", alpha=0.5)
    assert_close(got, reference("star", models["B"], models["F"][:1], alpha=0.5), models["B"])


@pytest.mark.parametrize("method", ["star", "cart"])
def test_identical_fine_tunes(tmp_path, models, method):
    """STAR: the average of two equal truncations is one; CART: the centred parts vanish (W = FT),
    and the records say so (their rounding, relative to the task vector, is no direction)."""
    fts = [models["fts"][0], models["fts"][0]]
    doc, got = run(models["base"], fts, tmp_path / "o", method)
    assert_close(got, reference(method, models["B"], [models["F"][0]] * 2), models["B"])
    if method == "cart":
        assert all(r["task_ranks"] == [0, 0] for r in doc["tensors"] if r.get("merge_rule") == "cart")


@pytest.mark.parametrize("method", ["star", "cart"])
def test_zero_deltas_give_base_exactly(tmp_path, models, method):
    """The reference code divides 0 by 0 for a zero task vector (STAR's rescale): here its
    directions are zeros and W = BASE, bit for bit."""
    doc, got = run(models["base"], [models["base"], models["base"]], tmp_path / "o", method)
    base = load_dir(models["base"])
    assert all(torch.equal(got[k], base[k]) for k in base)
    assert all(r["kept_directions"] == 0 for r in doc["tensors"] if r.get("merge_rule") == method)


@pytest.mark.parametrize("method", ["star", "cart"])
def test_thin_matrices(tmp_path, method):
    """1×N: averaged; 2×N and N×3: matrices (k = 1 for CART)."""
    base, fts = odd_shapes(tmp_path)
    _, got = run(base, fts, tmp_path / "o", method, policy=_policy(min_numel=0))
    b, f = as64(load_dir(base)), [as64(load_dir(x)) for x in fts]
    ref = {}
    for name, bb in b.items():
        fs = [x[name] for x in f]
        ref[name] = bb + (REFS[method](bb, fs) if is_matrix(bb) else np.mean([x - bb for x in fs], axis=0))
    assert_close(got, ref, b)


def test_a_cut_between_equal_singular_values_keeps_them_together(tmp_path):
    """Δ with singular values 1, 1, 1, 1, 0.5, ...: STAR at η 30 reaches 30 % of the nuclear norm
    at the second value, which equals the third and fourth — which of them is kept is rounding.
    The cut is extended over values the output cannot tell apart: all four kept, rescaled to keep
    the nuclear norm; the record's error bound says the kept subspace is determined."""
    g = torch.Generator().manual_seed(7)
    u = torch.linalg.qr(torch.randn((40, 16), generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn((16, 16), generator=g, dtype=torch.float64))[0]
    s = torch.tensor([1.0] * 4 + [0.5] * 4 + [0.25] * 8, dtype=torch.float64)
    delta = (u * s) @ v.T
    name = "model.layers.0.mlp.down_proj.weight"
    write_checkpoint(tmp_path / "b", [(name, torch.zeros((40, 16), dtype=torch.float64))], config=None)
    write_checkpoint(tmp_path / "f", [(name, delta)], config=None)
    doc, got = run(
        tmp_path / "b", [tmp_path / "f"], tmp_path / "o", "star", eta=30.0, policy=_policy(min_numel=0)
    )
    rec = next(r for r in doc["tensors"] if r["name"] == name)
    assert rec["task_ranks"] == [4] and rec["error_bound"] < 2.0**-24, rec
    want = (u[:, :4] * (s.sum() / 4.0)) @ v[:, :4].T
    assert np.abs(f64(got[name]) - want.numpy()).max() < 1e-9


@pytest.mark.parametrize("method", ["star", "cart"])
def test_no_whole_matrix_is_held_on_the_gram_route(tmp_path, models, method, monkeypatch):
    """The Gram route holds M × M Gram matrices and row blocks, never a task vector whole: with
    the machine's memory far below one dense SVD's working set, the merge is still written and
    exact."""
    import dghard_cli.methods.subspace as sub
    from dghard_cli.engine import working_memory as wm
    from dghard_cli.methods.low_rank import gram_route_bytes
    from dghard_cli.methods.subspace_svd import svd_route_bytes

    shapes = [v.shape for v in models["B"].values() if v.ndim == 2]
    limit = max(gram_route_bytes(*s, 3) for s in shapes)  # the Gram route's own check passes
    assert limit < max(svd_route_bytes(max(s), min(s), 3) for s in shapes)
    monkeypatch.setattr(wm, "machine_memory", lambda device=None: limit)
    whole = sub.TallBlocks.whole
    monkeypatch.setattr(sub.TallBlocks, "whole", lambda self: pytest.fail("a whole task vector was read"))
    doc, got = run(models["base"], models["fts"], tmp_path / "o", method)
    assert_close(got, reference(method, models["B"], models["F"]), models["B"])
    assert {r["route"] for r in doc["tensors"] if r.get("merge_rule") == method} == {"gram-eigh-float64"}
    monkeypatch.setattr(sub.TallBlocks, "whole", whole)


def _spread(tmp_path) -> str:
    """One 60 × 24 float64 delta with singular values from 1 down to 1e-5."""
    g = torch.Generator().manual_seed(3)
    u = torch.linalg.qr(torch.randn((60, 24), generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn((24, 24), generator=g, dtype=torch.float64))[0]
    s = torch.logspace(0, -5, 24, dtype=torch.float64)
    name = "model.layers.0.mlp.down_proj.weight"
    base = torch.randn((60, 24), generator=g, dtype=torch.float64)
    write_checkpoint(tmp_path / "b", [(name, base)], config=None)
    write_checkpoint(tmp_path / "f", [(name, base + (u * s) @ v.T)], config=None)
    return name


def _at_the_floor(tmp_path) -> str:
    """One 60 × 24 float64 delta with a singular value at the numerical rank's floor,
    σ = sqrt(4·M·ε)·σ_max: whether it is a direction is decided by rounding."""
    g = torch.Generator().manual_seed(5)
    u = torch.linalg.qr(torch.randn((60, 24), generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn((24, 24), generator=g, dtype=torch.float64))[0]
    s = torch.zeros(24, dtype=torch.float64)
    s[:6] = torch.tensor([1.0, 0.8, 0.6, 0.4, 0.3, 0.2])
    s[6] = math.sqrt(4 * 24 * 2.0**-52)
    name = "model.layers.0.mlp.down_proj.weight"
    write_checkpoint(tmp_path / "b", [(name, torch.zeros((60, 24), dtype=torch.float64))], config=None)
    write_checkpoint(tmp_path / "f", [(name, (u * s) @ v.T)], config=None)
    return name


def test_keeping_every_direction_costs_the_gram_route_nothing(tmp_path):
    """STAR at η 100 keeps every direction of a delta whose σ span 1 … 1e-5: rotations within the
    kept subspace cancel in X·V·Vᵀ, so the Gram route's bound is √N·ε·σ_max/σ_min (2e-10), fine for
    a float32 output (a review found λ_max/λ_min, 2e-6, sent such matrices to the accurate route)."""
    name = _spread(tmp_path)
    doc, got = run(
        tmp_path / "b", [tmp_path / "f"], tmp_path / "o", "star", eta=100.0, policy=_policy(min_numel=0)
    )
    rec = next(r for r in doc["tensors"] if r["name"] == name)
    b, f = as64(load_dir(tmp_path / "b")), as64(load_dir(tmp_path / "f"))
    assert_close(got, {name: b[name] + ref_star(b[name], [f[name]], eta=100.0)}, b)
    assert rec["route"] == "gram-eigh-float64" and rec["error_bound"] < 1e-9, rec


@pytest.mark.parametrize("dtype", ["F32", "BF16"])
def test_a_matrix_the_gram_route_cannot_resolve_takes_the_accurate_route(tmp_path, dtype):
    """A singular value at the floor (1.5e-7 of the largest) is in the result or not by rounding:
    the Gram route's bound counts it, enough for a bf16 output, not for float32, where the matrix is
    computed again from the SVDs of the task vectors and the record keeps both bounds."""
    name = _at_the_floor(tmp_path)
    doc, got = run(
        tmp_path / "b",
        [tmp_path / "f"],
        tmp_path / "o",
        "star",
        policy=_policy(min_numel=0, out_dtype=dtype),
    )
    rec = next(r for r in doc["tensors"] if r["name"] == name)
    b, f = as64(load_dir(tmp_path / "b")), as64(load_dir(tmp_path / "f"))
    unit = 2.0**-24 if dtype == "F32" else 2.0**-8  # the output's rounding
    assert_close(got, {name: b[name] + ref_star(b[name], [f[name]])}, b, unit=unit)
    if dtype == "F32":
        assert rec["route"] == "svd-float64" and rec["error_bound"] < 2.0**-24
        assert 2.0**-24 < rec["gram_error_bound"] < 1e-5
        assert doc["merge"]["accurate_route_matrices"] == 1
    else:
        assert rec["route"] == "gram-eigh-float64" and 2.0**-24 < rec["error_bound"] < 2.0**-8
        assert "accurate_route_matrices" not in doc["merge"]


def test_the_accurate_route_that_cannot_fit_is_refused_in_one_line(tmp_path, monkeypatch):
    """Where the accurate route is needed and its SVDs cannot fit, one line names the tensor,
    the bound and what to do (here: a bf16 output, which the Gram route resolves), and nothing is
    written."""
    import dghard_cli.engine.working_memory as wm
    from dghard_cli.methods.low_rank import gram_route_bytes

    name = _at_the_floor(tmp_path)
    # room for the Gram route (checked before writing), not for the accurate route's SVDs
    monkeypatch.setattr(wm, "machine_memory", lambda device=None: gram_route_bytes(60, 24, 1))
    with pytest.raises(Exception) as e:
        run(tmp_path / "b", [tmp_path / "f"], tmp_path / "o", "star", policy=_policy(min_numel=0))
    msg = str(e.value)
    assert name in msg and "--method star" in msg and "--dtype bf16" in msg and len(msg.splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_cart_keeps_the_centred_part_of_a_zero_task_vector(tmp_path, models):
    """A fine-tune equal to BASE (a LoRA adapter that does not touch a module) has Δ = 0, but its
    centred part −τ̄ is not zero: its rank floor is relative to the mean it came from too. Found by
    a review: both routes dropped it (42 % off the formula)."""
    fts = [models["base"], *models["fts"][:2]]
    _, got = run(models["base"], fts, tmp_path / "o", "cart")
    ref = reference("cart", models["B"], [models["B"], *models["F"][:2]])
    assert_close(got, ref, models["B"])


def test_cart_parts_of_very_different_scales_take_the_same_cut_on_both_routes():
    """Two exactly rank-4 task vectors 1e-7 apart in scale: the Gram route floors every centred
    part relative to the same reference as the accurate route (a review found ranks [4, 4]
    against [7, 4], 2e-7 apart, with a claimed bound of 6e-15)."""
    from dghard_cli.methods.low_rank import EPS64, cart, cart_gram, project

    g = torch.Generator().manual_seed(1)
    n, m = 300, 64

    def low_rank(scale):
        return (
            scale
            * torch.randn((n, 4), generator=g, dtype=torch.float64)
            @ torch.randn((4, m), generator=g, dtype=torch.float64)
        )

    xs = [low_rank(1e-7), low_rank(1.0)]
    unit = 2.0**-24
    acc = cart(xs, 0.12, 2.0, unit)
    mean = (xs[0] + xs[1]) / 2
    refs = [max(float(torch.linalg.vector_norm(x)), float(torch.linalg.vector_norm(mean))) for x in xs]
    cuts, _ = cart_gram([(x - mean).T @ (x - mean) for x in xs], refs, (n, m), 0.12, unit)
    got = mean.clone()
    for x, c in zip(xs, cuts, strict=True):
        if c.r:
            got += 2.0 * project(x - mean, c)
    assert [c.r for c in cuts] == acc.stats["task_ranks"]
    bound = EPS64 * max(c.amplification for c in cuts)
    assert bound <= unit
    assert float((got - acc.delta).abs().max() / acc.delta.abs().max()) <= max(bound, 1e-13)


def _spectrum(sig):
    from dghard_cli.spectral.spectrum import Spectrum

    v = torch.eye(len(sig), dtype=torch.float64)
    return Spectrum(shape=(100, len(sig)), sigma=np.asarray(sig, dtype=np.float64), fro2=0.0, full_vectors=v)


def test_the_gram_cut_is_sent_to_the_accurate_route_where_a_decision_is_within_its_error():
    """STAR's η-crossing and every comparison of the tie extension are decided on the Gram route
    only where they lie farther from their thresholds than its error, else its amplification is
    inf (the accurate route); a component at the numerical rank's floor adds its σ to the bound."""
    from dghard_cli.methods.low_rank import EPS64, gram_cut, star_rank

    unit = 2.0**-24
    sig = [4.0, 2.0, 1.0, 0.5, 0.25]
    lam = np.asarray(sig) ** 2
    far = gram_cut(_spectrum(sig), lam, 16.0, star_rank(50.0), unit, rescale=True, eta=50.0)
    assert far.r == 1 and math.isfinite(far.amplification)  # 4 of 7.75: 51.6 %, 1.6 points above 50 %
    assert far.scale == pytest.approx(7.75 / 4.0)
    # η = 51.6129... puts the crossing within the sums' error
    eta = 100.0 * 4.0 / 7.75 * (1 - 1e-15)
    near = gram_cut(_spectrum(sig), lam, 16.0, star_rank(eta), unit, rescale=True, eta=eta)
    assert near.amplification == math.inf
    # an eigenvalue at the numerical rank's floor: its σ (1.5e-7 of σ_max here) is in the bound
    floor = 4.0 * 5 * 2.0**-52 * 16.0
    edge = gram_cut(_spectrum(sig), np.append(lam[:4], floor * (1 + 1e-3)), 16.0, star_rank(50.0), unit)
    assert EPS64 * edge.amplification >= math.sqrt(floor / 16.0) > unit
    # the tie extension: its first comparison within error, its last one far (a review found only
    # the last one checked)
    bf16 = 2.0**-8
    delta = EPS64 * 4.0 / bf16
    ties = [4.0, 2.0, 2.0 - delta + 1e-17, 1.0, 0.5]
    cut = gram_cut(_spectrum(ties), np.asarray(ties) ** 2, 16.0, lambda s, rank: 2, bf16)
    assert cut.r == 3 and cut.amplification == math.inf


def test_the_gram_routes_bounds_grow_with_the_row_count():
    """A float64 Gram matrix of N rows is off by more than ε·λ_max once N is in the thousands
    (measured here against an 80-bit sum: 9·ε·λ_max at N = 20 000), which the Gram routes' bounds
    assumed before; ``gram_growth`` (√N) covers it, and a cut's bound on the same Gram matrix grows
    with the rows it was summed over."""
    from dghard_cli.methods.low_rank import EPS64, gram_cut, gram_spectrum, star_rank
    from dghard_cli.spectral.routes import gram_growth

    x = np.random.default_rng(0).standard_normal((20_000, 16)) + 3.0
    exact = np.einsum("ni,nj->ij", x.astype(np.longdouble), x.astype(np.longdouble))

    def err_of(g: np.ndarray) -> float:
        return float(np.linalg.norm((g.astype(np.longdouble) - exact).astype(np.float64), 2))

    xt = torch.from_numpy(x)
    got = (xt.T @ xt).numpy()
    lam_max = float(np.linalg.eigvalsh(got)[-1])
    # how far a product is from ε·λ_max depends on how the BLAS kernel splits the sum (0.3-0.5
    # on one AVX-512 machine, 9 on another); a row-by-row float64 sum, what a Gram matrix
    # accumulated over many small row blocks tends to, is 9 here on every machine
    sequential = np.cumsum(x[:, :, None] * x[:, None, :], axis=0)[-1]
    assert 4 * EPS64 * lam_max < err_of(sequential) <= gram_growth(20_000) * EPS64 * lam_max
    assert err_of(got) <= gram_growth(20_000) * EPS64 * lam_max

    g = torch.from_numpy(got)
    amps = []
    for rows in (100, 10_000):
        spec, lam, ref = gram_spectrum(g, (rows, 16))
        amps.append(gram_cut(spec, lam, ref, star_rank(40.0), 2.0**-24).amplification)
    assert amps[1] == pytest.approx(10.0 * amps[0], rel=1e-6)
