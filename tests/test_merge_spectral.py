"""TSV-M, Iso-C and Iso-CTS against float64 numpy references written here from the papers'
formulas (full ``np.linalg.svd``, nothing imported from the package's math), on generated
sharded checkpoints (three fine-tunes of one BASE: ``make_pair`` with one ``seed`` and different
``delta_seed``s; Llama names, square, tall and wide matrices, tied and untied vocabularies); the
layer-strength schedule on top; recipe keys; ``--format peft`` against the full merge; and the
degenerate inputs (one fine-tune, identical fine-tunes, Δ = 0, 1×N tensors, min(m, n) < T,
bf16 extremes, an ill-conditioned matrix), each a finite documented result or a one-line
refusal with exit 2.

Tolerances: every merged entry within ``1e-6·max|Δ*|`` of the reference (Δ* = the reference's
merged update of that tensor) plus the output dtype's rounding of the entry (``2⁻²⁴·|W|`` for
float32, ``2⁻⁸·|W|`` for bf16). The float64 Gram route's own error is bounded by the recorded
``error_bound`` (≤ 2e-9 on these matrices).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from conftest import f64, load_dir, run_dghard
from safetensors.torch import load_file

from dghard_cli.engine.writer import RunOptions
from dghard_cli.errors import InputError
from dghard_cli.lora.output import LoraOutputOptions
from dghard_cli.merging import MergeOptions, merge
from dghard_cli.methods import registry
from dghard_cli.recipes.recipe import top_keys
from dghard_cli.schedule.spec import LayerSchedule
from dghard_cli.testing.synthetic import ArchConfig, make_pair, write_checkpoint

CFG = ArchConfig(hidden_size=48, intermediate_size=100, num_hidden_layers=2, vocab_size=160)
TIED = dataclasses.replace(CFG, tie_word_embeddings=True)
REL = 1e-6
U32, UBF16 = 2.0**-24, 2.0**-8

# -- references (the papers' formulas, float64, full SVDs) -----------------------------------------


def is_matrix(t: np.ndarray) -> bool:  # the eligibility rule: 2-D, both sides >= 2 (min-numel 0 here)
    return t.ndim == 2 and min(t.shape) >= 2


def numerical_rank(s: np.ndarray, scale: float | None = None) -> int:
    """Singular values above 1e-6·σ_max (the package's floor, ≈ 2e-7·σ_max here, is below it, and
    no test matrix has a singular value between the two); ``scale``: the σ_max of the matrix a
    projected one came from (its rounding is relative to that)."""
    top = scale if scale is not None else (s[0] if s.size else 0.0)
    return int(np.count_nonzero(s > 1e-6 * top)) if top > 0 else 0


def polar(a: np.ndarray) -> np.ndarray:
    """P·Qᵀ over the non-zero singular values of ``a`` (the partial isometry)."""
    if a.shape[1] == 0:
        return a
    p, s, qt = np.linalg.svd(a, full_matrices=False)
    r = numerical_rank(s)
    return p[:, :r] @ qt[:r]


def svd_top(a: np.ndarray, k: int, scale: float | None = None):
    u, s, vt = np.linalg.svd(a, full_matrices=False)
    k = min(k, numerical_rank(s, scale))
    return u[:, :k], s[:k], vt[:k].T


def ref_tsv(b, fs, alpha=1.0, k=None):
    T, s = len(fs), min(b.shape)
    k = max(1, min(k, s)) if k is not None else max(1, s // T)
    parts = [svd_top(f - b, k) for f in fs]
    u = np.concatenate([p[0] for p in parts], 1)
    sig = np.concatenate([p[1] for p in parts])
    v = np.concatenate([p[2] for p in parts], 1)
    return alpha * polar(u) @ np.diag(sig) @ polar(v).T


def ref_iso_c(b, fs, alpha=1.0):
    u, s, v = svd_top(sum(f - b for f in fs), min(b.shape))
    return alpha * (s.mean() if s.size else 0.0) * u @ v.T


def ref_iso_cts(b, fs, alpha=1.0, fraction=0.8):
    T, s = len(fs), min(b.shape)
    k_c = int(s * fraction)
    d = round((s - k_c) / T)
    if d * T > s:
        d = s // T
    k_c = s - d * T
    uc, sc, vc = svd_top(sum(f - b for f in fs), k_c)
    us, ss, vs = [], [], []
    for f in fs:
        delta = f - b
        top = np.linalg.norm(delta, 2)
        u, sig, v = svd_top(delta - uc @ (uc.T @ delta), d, top) if d else (uc[:, :0], sc[:0], vc[:, :0])
        us.append(u), ss.append(sig), vs.append(v)
    sig = np.concatenate([*ss, sc])
    u, v = np.concatenate([*us, uc], 1), np.concatenate([*vs, vc], 1)
    return alpha * (sig.mean() if sig.size else 0.0) * polar(u) @ polar(v).T


REFS = {"tsv": ref_tsv, "iso-c": ref_iso_c, "iso-cts": ref_iso_cts}


def reference(method, base, fts, **kw):
    """Every tensor's reference value: the method on matrices, BASE + α·mean Δ_i elsewhere."""
    out = {}
    alpha = kw.get("alpha", 1.0)
    for name, b in base.items():
        fs = [f[name] for f in fts]
        if is_matrix(b):
            out[name] = b + REFS[method](b, fs, **kw)
        else:
            out[name] = b + alpha * np.mean([f - b for f in fs], axis=0)
    return out


def assert_close(got: dict, ref: dict, base: dict, unit: float = U32, rel: float = REL) -> None:
    for name, r in ref.items():
        g = f64(got[name])
        scale = np.abs(r - base[name]).max()
        err = np.abs(g - r) - unit * np.abs(r)
        assert err.max() <= rel * scale, (name, float(err.max() / max(scale, 1e-300)))


def as64(sd: dict) -> dict:
    return {k: f64(v) for k, v in sd.items()}


# -- fixtures -------------------------------------------------------------------------------------


def three(root, cfg, dtype="float32", delta=None):
    base, ft1 = make_pair(root / "a", cfg, ft_shards=3, seed=0, dtype=dtype, delta=delta)
    _, ft2 = make_pair(root / "b", cfg, ft_shards=1, seed=0, delta_seed=11, dtype=dtype, delta=delta)
    _, ft3 = make_pair(root / "c", cfg, ft_shards=2, seed=0, delta_seed=22, dtype=dtype, delta=delta)
    return base, [ft1, ft2, ft3]


def model_set(root) -> dict:
    """BASE and three fine-tunes, untied and tied vocabularies, and their float64 tensors (the
    fixture of every merge-method test file)."""
    base, fts = three(root / "untied", CFG)
    tbase, tfts = three(root / "tied", TIED)
    return {
        "base": base,
        "fts": fts,
        "B": as64(load_dir(base)),
        "F": [as64(load_dir(f)) for f in fts],
        "tbase": tbase,
        "tfts": tfts,
        "TB": as64(load_dir(tbase)),
        "TF": [as64(load_dir(f)) for f in tfts],
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return model_set(tmp_path_factory.mktemp("spectral-merge"))


def opts(method, **kw) -> MergeOptions:
    fields = {f.name for f in dataclasses.fields(MergeOptions)}
    extra = {k: kw.pop(k) for k in list(kw) if k not in fields}
    run = kw.pop("run", RunOptions(device="cpu", quiet=True))
    return MergeOptions(method=method, run=run, extra=extra, **kw)


def run(base, fts, out, method, **kw):
    doc = merge(base, fts, out, opts(method, **kw))
    return doc, load_dir(out)


# -- the methods against their references ---------------------------------------------------------


@pytest.mark.parametrize(
    "method,kw",
    [
        ("tsv", {}),
        ("tsv", {"alpha": 0.7, "tsv_rank": 5}),
        ("iso-c", {}),
        ("iso-c", {"alpha": 1.4}),
        ("iso-cts", {}),
        ("iso-cts", {"alpha": 0.9, "common_space_fraction": 0.5}),
    ],
)
def test_methods_match_the_float64_references(tmp_path, models, method, kw):
    doc, got = run(models["base"], models["fts"], tmp_path / "o", method, **kw)
    rk = {"k": kw["tsv_rank"]} if "tsv_rank" in kw else {}
    if "common_space_fraction" in kw:
        rk["fraction"] = kw["common_space_fraction"]
    ref = reference(
        method, models["B"], models["F"], **({"alpha": kw["alpha"]} if "alpha" in kw else {}), **rk
    )
    assert_close(got, ref, models["B"])
    recs = {r["name"]: r for r in doc["tensors"]}
    q = recs["model.layers.0.self_attn.q_proj.weight"]
    assert q["merge_rule"] == method and q["route"] == "gram-eigh-float64" and q["error_bound"] < 2e-9
    assert recs["model.norm.weight"]["merge_rule"] == "average"
    assert doc["parameters"]["alpha"] == kw.get("alpha", 1.0)
    assert doc["merge"]["subspace_matrices"] == 2 + 2 * 7  # embeddings, head, 7 per layer
    if method == "tsv":
        assert q["per_task_rank"] == kw.get("tsv_rank", 48 // 3)
        assert doc["parameters"].get("tsv_rank") == kw.get("tsv_rank")  # the default: not a value
    if method == "iso-cts":
        assert doc["parameters"]["common_space_fraction"] == kw.get("common_space_fraction", 0.8)


@pytest.mark.parametrize("method", ["tsv", "iso-cts"])
def test_tied_embeddings_and_small_row_blocks(tmp_path, models, method):
    """A tied vocabulary (the head is the written embedding), and row blocks of a few rows each
    (every pass streams; the wide matrices in column blocks): the same result."""
    doc, got = run(models["tbase"], models["tfts"], tmp_path / "o", method, block_bytes=8 * 48 * 5)
    assert "lm_head.weight" not in got
    assert_close(got, reference(method, models["TB"], models["TF"]), models["TB"])


def test_layer_strengths_compose(tmp_path, models):
    """``--lines A,B``: W = W_base + λ(ℓ)·Δ*, λ from the report, equal to A + B·ℓ/(L−1) in layers."""
    doc, got = run(models["base"], models["fts"], tmp_path / "o", "iso-cts", schedule=LayerSchedule(0.3, 0.6))
    ref = reference("iso-cts", models["B"], models["F"])
    recs = {r["name"]: r for r in doc["tensors"]}
    assert recs["model.layers.1.mlp.up_proj.weight"]["layer_strength"] == pytest.approx(0.9)
    assert recs["model.layers.0.mlp.up_proj.weight"]["layer_strength"] == pytest.approx(0.3)
    scaled = {}
    for name, r in ref.items():
        lam = recs[name]["layer_strength"]
        scaled[name] = models["B"][name] + lam * (r - models["B"][name])
    assert_close(got, scaled, models["B"])
    assert doc["parameters"]["lines"] == [0.3, 0.6]


def test_registry_recipe_keys_and_flags(tmp_path, models):
    keys = registry.recipe_keys()
    assert keys["tsv_rank"] == "integer" and keys["common_space_fraction"] == "number"
    assert {"tsv_rank", "common_space_fraction", "alpha", "lines"} <= set(top_keys())
    for m in ("tsv", "iso-c", "iso-cts"):
        assert registry.get_method(m).all_params[-4:] == (
            "lines",
            "layer_strengths",
            "calibrate",
            "svc_alpha",
        )
    assert registry.params()["tsv_rank"].cli_flag == "--tsv-rank"
    assert registry.params()["common_space_fraction"].cli_flag == "--common-space-fraction"
    r = tmp_path / "r.yaml"
    fts = "".join(f"  - {f}\n" for f in models["fts"])
    r.write_text(
        f"method: iso-cts\nbase: {models['base']}\nmodels:\n{fts}out: {tmp_path / 'rec'}\n"
        "alpha: 0.8\ncommon_space_fraction: 0.5\n"
    )
    res = run_dghard("merge", "--config", r, "--device", "cpu", "--quiet")
    assert res.returncode == 0, res.stderr
    flags = run_dghard(
        "merge", "--method", "iso-cts", "--alpha", "0.8", "--common-space-fraction", "0.5",
        models["base"], *models["fts"], "--out", tmp_path / "cli", "--device", "cpu", "--quiet",
    )  # fmt: skip
    assert flags.returncode == 0, flags.stderr
    a, b = load_dir(tmp_path / "rec"), load_dir(tmp_path / "cli")
    assert all(torch.equal(a[k], b[k]) for k in a)
    ref = reference("iso-cts", models["B"], models["F"], alpha=0.8, fraction=0.5)
    assert_close(a, ref, models["B"])


@pytest.mark.parametrize(
    "args,message",
    [
        (["--method", "tsv", "--tsv-rank", "0"], "--tsv-rank must be a whole number >= 1"),
        (
            ["--method", "iso-cts", "--common-space-fraction", "1.5"],
            "--common-space-fraction must be in [0, 1]",
        ),
        (["--method", "iso-c", "--alpha", "-1"], "--alpha must be in [0, inf]"),
        (["--method", "iso-c", "--tsv-rank", "3"], "--tsv-rank does not apply to --method iso-c"),
        (["--method", "tsv", "--weights", "1,1,1"], "--weights does not apply to --method tsv"),
    ],
)
def test_bad_parameters_are_one_line_refusals(tmp_path, models, args, message):
    res = run_dghard(
        "merge", *args, models["base"], *models["fts"], "--out", tmp_path / "o", "--device", "cpu"
    )
    assert res.returncode == 2 and message in res.stderr and len(res.stderr.strip().splitlines()) == 1, (
        res.stderr
    )
    assert not (tmp_path / "o").exists()


# -- --format peft --------------------------------------------------------------------------------


def adapter_deltas(out, base) -> dict[str, np.ndarray]:
    """Δ per tensor of an adapter output (scaling 1: ΔW = B·A; whole tensors: value − BASE)."""
    sd = {k: f64(v) for k, v in load_file(str(out / "adapter_model.safetensors")).items()}
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["lora_alpha"] == cfg["r"] and cfg["alpha_pattern"] == cfg["rank_pattern"]
    p = "base_model.model."
    got = {}
    for key, t in sd.items():
        name = key[len(p) :]
        if name.endswith(".lora_A.weight"):
            m = name[: -len(".lora_A.weight")]
            got[m + ".weight"] = sd[f"{p}{m}.lora_B.weight"] @ t
        elif name.endswith(".lora_embedding_A"):  # PEFT's embedding layout: ΔW = (B·A)ᵀ
            m = name[: -len(".lora_embedding_A")]
            got[m + ".weight"] = (sd[f"{p}{m}.lora_embedding_B"] @ t).T
        elif ".lora_" not in name:
            name = name.replace(".modules_to_save.default.", ".").replace(".base_layer.", ".")
            if name in base:
                got[name] = t - base[name]
    return got


def test_peft_output_equals_the_full_merge(tmp_path, models):
    """A low-rank TSV (T·k = 6 directions) written as LoRA factors: B·A equals the full merge's Δ."""
    _, full = run(models["base"], models["fts"], tmp_path / "full", "tsv", tsv_rank=2)
    doc = merge(
        models["base"], models["fts"], tmp_path / "peft",
        opts("tsv", tsv_rank=2, lora=LoraOutputOptions(format="peft")),
    )  # fmt: skip
    got = adapter_deltas(tmp_path / "peft", models["B"])
    lora = [r for r in doc["tensors"] if r.get("written_as") == "lora"]
    assert len(lora) == 16 and all(r["rank"] == 6 for r in lora)
    for name, d in got.items():
        want = f64(full[name]) - models["B"][name]
        tol = REL * np.abs(want).max() + 2 * U32 * np.abs(f64(full[name])).max()
        assert np.abs(d - want).max() <= tol, name
    assert set(got) == set(models["B"])


def test_peft_of_a_flat_spectrum_needs_a_rank(tmp_path, models):
    res = run_dghard(
        "merge", "--method", "iso-c", models["base"], *models["fts"], "--out", tmp_path / "o",
        "--format", "peft", "--device", "cpu",
    )  # fmt: skip
    assert res.returncode == 2 and "is not low-rank" in res.stderr and "--rank R" in res.stderr, res.stderr


# -- degenerate inputs ----------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["tsv", "iso-c", "iso-cts"])
def test_one_fine_tune(tmp_path, models, method):
    """TSV: k = min(m, n), Δ* = α·Δ; Iso: the flattened spectrum of Δ alone."""
    _, got = run(models["base"], models["fts"][:1], tmp_path / "o", method, alpha=0.5)
    ref = reference(method, models["B"], models["F"][:1], alpha=0.5)
    assert_close(got, ref, models["B"])
    if method == "tsv":
        want = {k: models["B"][k] + 0.5 * (models["F"][0][k] - models["B"][k]) for k in models["B"]}
        assert_close(got, want, models["B"])


@pytest.mark.parametrize("method", ["tsv", "iso-c", "iso-cts"])
def test_identical_fine_tunes(tmp_path, models, method):
    """TSV: the partial-isometry polar factor gives back one task's top-k (Δ* = α·[Δ]_k, k = ⌊s/2⌋);
    Iso: the flat spectrum of 2·Δ."""
    fts = [models["fts"][0], models["fts"][0]]
    _, got = run(models["base"], fts, tmp_path / "o", method)
    ref = reference(method, models["B"], [models["F"][0]] * 2)
    assert_close(got, ref, models["B"])
    if method == "tsv":
        b, f = (
            models["B"]["model.layers.0.mlp.up_proj.weight"],
            models["F"][0]["model.layers.0.mlp.up_proj.weight"],
        )
        u, s, vt = np.linalg.svd(f - b, full_matrices=False)
        want = {"w": b + (u[:, :24] * s[:24]) @ vt[:24]}
        assert_close({"w": got["model.layers.0.mlp.up_proj.weight"]}, want, {"w": b})


@pytest.mark.parametrize("method", ["tsv", "iso-c", "iso-cts"])
def test_zero_deltas_give_base_exactly(tmp_path, models, method):
    fts = [models["base"], models["base"]]
    doc, got = run(models["base"], fts, tmp_path / "o", method)
    base = load_dir(models["base"])
    assert all(torch.equal(got[k], base[k]) for k in base)
    assert all(r["rank"] == 0 for r in doc["tensors"] if r.get("merge_rule") == method)


def odd_shapes(root, dtype=torch.float32, scale=1.0, n=3):
    """BASE and n fine-tunes with a 1×N matrix, a 2×N one (min(m, n) = 2 < T = 3), a 3×40 one."""
    shapes = {
        "model.layers.0.mlp.gate_proj.weight": (1, 300),
        "model.layers.0.mlp.up_proj.weight": (2, 300),
        "model.layers.0.mlp.down_proj.weight": (40, 3),
        "model.norm.weight": (40,),
    }
    g = torch.Generator().manual_seed(5)
    base = {k: torch.randn(s, generator=g, dtype=torch.float64) * scale for k, s in shapes.items()}
    dirs = []
    for i in range(n + 1):
        t = base if i == 0 else {k: v + 0.1 * scale * torch.randn(v.shape, generator=g, dtype=torch.float64)
                                 for k, v in base.items()}  # fmt: skip
        d = root / f"m{i}"
        write_checkpoint(d, [(k, v.to(dtype)) for k, v in t.items()], config=CFG.to_hf("float32"))
        dirs.append(d)
    return dirs[0], dirs[1:]


@pytest.mark.parametrize("method", ["tsv", "iso-c", "iso-cts"])
def test_thin_matrices_and_fewer_directions_than_fine_tunes(tmp_path, method):
    """1×N: averaged; min(m, n) < T: TSV keeps k = 1 per task, Iso-CTS is Iso-C (d = 0)."""
    base, fts = odd_shapes(tmp_path)
    doc, got = run(base, fts, tmp_path / "o", method, policy=_policy(min_numel=0))
    b, f = as64(load_dir(base)), [as64(load_dir(x)) for x in fts]
    ref = {}
    for name, bb in b.items():
        fs = [x[name] for x in f]
        ref[name] = bb + (REFS[method](bb, fs) if is_matrix(bb) else np.mean([x - bb for x in fs], axis=0))
    assert_close(got, ref, b)
    recs = {r["name"]: r for r in doc["tensors"]}
    assert recs["model.layers.0.mlp.gate_proj.weight"]["merge_rule"] == "average"
    up = recs["model.layers.0.mlp.up_proj.weight"]
    assert up["merge_rule"] == method and up["rank"] == 2
    if method == "tsv":
        assert up["per_task_rank"] == 1 and up["task_ranks"] == [1, 1, 1]
    if method == "iso-cts":
        assert up["common_rank"] == 2 and up["task_ranks"] == [0, 0, 0]


def _policy(**kw):
    from dghard_cli.engine.plan import PolicyOptions

    return PolicyOptions(**kw)


@pytest.mark.parametrize("scale", [1e-30, 1e30])
def test_bf16_extremes_are_finite_and_match(tmp_path, scale):
    """bf16 inputs near the bottom and the top of its range: float64 spectra, a finite result."""
    base, fts = odd_shapes(tmp_path, dtype=torch.bfloat16, scale=scale)
    _, got = run(base, fts, tmp_path / "o", "iso-cts", policy=_policy(min_numel=0))
    b, f = as64(load_dir(base)), [as64(load_dir(x)) for x in fts]
    ref = {n: bb + (ref_iso_cts(bb, [x[n] for x in f]) if is_matrix(bb) else np.mean([x[n] - bb for x in f], 0))
           for n, bb in b.items()}  # fmt: skip
    assert all(bool(torch.isfinite(t).all()) for t in got.values())
    assert_close(got, ref, b, unit=UBF16)


def test_overflowing_result_is_refused_not_written(tmp_path):
    base, fts = odd_shapes(tmp_path, dtype=torch.bfloat16, scale=1e37)
    res = run_dghard(
        "merge", "--method", "iso-c", "--alpha", "1000", "--min-numel", "0", base, *fts,
        "--out", tmp_path / "o", "--device", "cpu", "--quiet",
    )  # fmt: skip
    assert res.returncode == 2 and "exceed BF16's range" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


@pytest.mark.parametrize("method", ["tsv", "iso-c", "iso-cts"])
@pytest.mark.parametrize("dtype,wider", [("bf16", "fp32"), ("fp32", "fp64"), ("fp64", None)])
def test_alpha_at_the_top_of_the_float_range_is_a_refusal_with_a_hint_that_helps(
    tmp_path, models, method, dtype, wider
):
    """α = 1e308 passes the α >= 0 check; the merged update then overflows. iso-c reported it
    as "the merge produced NaN/Inf" (exit 3, as an internal failure), and every method advised
    "--dtype fp32" to a float32 or float64 output."""
    res = run_dghard(
        "merge", "--method", method, "--alpha", "1e308", models["base"], *models["fts"],
        "--out", tmp_path / "o", "--device", "cpu", "--dtype", dtype, "--quiet",
    )  # fmt: skip
    line = res.stderr.strip()
    assert res.returncode == 2 and len(line.splitlines()) == 1, res.stderr
    assert "lower the strengths" in line and "--alpha" in line
    if "float64 from finite inputs" in line or wider is None:  # no wider dtype would help
        assert "wider output" not in line
    else:
        assert f"exceed {dtype.upper().replace('FP', 'F')}'s range" in line and f"--dtype {wider}" in line
    assert not (tmp_path / "o").exists()


def ill_conditioned_delta() -> torch.Tensor:
    """A 64 × 32 float64 delta with singular values from 1 down to 3e-6 (logspace 0 to −5.5)."""
    g = torch.Generator().manual_seed(3)
    u = torch.linalg.qr(torch.randn((64, 32), generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn((32, 32), generator=g, dtype=torch.float64))[0]
    return (u * torch.logspace(0, -5.5, 32, dtype=torch.float64)) @ v.T


@pytest.mark.parametrize("method", ["iso-c", "iso-cts", "tsv"])
def test_ill_conditioned_matrix_takes_the_accurate_route_for_float32_and_the_gram_route_for_bf16(
    tmp_path, method
):
    """Σ Δ_i with singular values from 1 down to 3e-6: the flat spectrum (or the orthogonalisation)
    divides by σ_min, and the Gram route's bound ε·κ² ≈ 2e-5 exceeds float32's resolution. A
    float32 output was refused (exit 2, "write --dtype bf16"); it is now computed by float64 SVDs
    of the matrices (bound ε·κ ≈ 7e-11), recorded as such, and equals the reference to float32
    rounding. bf16's resolution is met by the Gram route, which it keeps."""
    delta = ill_conditioned_delta()
    name = "model.layers.0.mlp.up_proj.weight"
    zero = torch.zeros((64, 32), dtype=torch.float32)
    write_checkpoint(tmp_path / "b", [(name, zero)], config=CFG.to_hf("float32"))
    fts = []
    for i, scale in enumerate((1.0, 0.5)):  # two fine-tunes: Iso-CTS's task spaces are not empty
        write_checkpoint(
            tmp_path / f"f{i}", [(name, (scale * delta).to(torch.float32))], config=CFG.to_hf("float32")
        )
        fts.append(tmp_path / f"f{i}")
    ds = [f64(load_dir(f)[name]) for f in fts]
    kw = {"tsv_rank": 32} if method == "tsv" else {}  # TSV divides by each task's k-th value
    ref = REFS[method](np.zeros_like(ds[0]), [d for d in ds], **({"k": 32} if kw else {}))
    for dtype, route, unit in (("F32", "svd-float64", U32), ("BF16", "gram-eigh-float64", UBF16)):
        out = tmp_path / f"o-{dtype}"
        doc, got = run(tmp_path / "b", fts, out, method, policy=_policy(out_dtype=dtype), **kw)
        rec = next(r for r in doc["tensors"] if r["name"] == name)
        assert rec["route"] == route, rec
        if route == "svd-float64":
            assert rec["error_bound"] < 1e-9 < U32 < rec["gram_error_bound"], rec
            assert doc["merge"]["accurate_route_matrices"] == 1
        else:
            assert "gram_error_bound" not in rec and "accurate_route_matrices" not in doc["merge"]
        err = np.abs(f64(got[name]) - ref)
        assert (err <= unit * np.abs(ref) + REL * np.abs(ref).max()).all(), (dtype, err.max())


@pytest.mark.parametrize("method", ["tsv", "iso-c"])
def test_a_layer_schedule_checks_the_written_dtype_not_its_float64_intermediate(tmp_path, method):
    """``--lines`` asks the method for float64 before its own cast: the accuracy check is still the
    written dtype's, not float32's under the label F64 for every dtype — float32 takes the accurate
    route (it was refused, naming F32), bf16 the Gram route; both equal W_base + λ·Δ*."""
    g = torch.Generator().manual_seed(3)
    u = torch.linalg.qr(torch.randn((64, 32), generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn((32, 32), generator=g, dtype=torch.float64))[0]
    delta = (u * torch.logspace(0, -5.5, 32, dtype=torch.float64)) @ v.T
    name = "model.layers.0.mlp.up_proj.weight"
    zero = torch.zeros((64, 32), dtype=torch.float32)
    one = dataclasses.replace(CFG, num_hidden_layers=1)  # --lines checks the config against the blocks
    write_checkpoint(tmp_path / "b", [(name, zero)], config=one.to_hf("float32"))
    write_checkpoint(tmp_path / "f", [(name, delta.to(torch.float32))], config=one.to_hf("float32"))
    args = ("merge", "--method", method, tmp_path / "b", tmp_path / "f", "--lines", "0.5,0")
    d = f64(load_dir(tmp_path / "f")[name])
    ref = 0.5 * (ref_iso_c if method == "iso-c" else ref_tsv)(np.zeros_like(d), [d])
    for dtype, route, unit in (("fp32", "svd-float64", U32), ("bf16", "gram-eigh-float64", UBF16)):
        out = tmp_path / f"o-{dtype}"
        ok = run_dghard(*args, "--out", out, "--dtype", dtype, "--report", tmp_path / f"{dtype}.json")
        assert ok.returncode == 0, ok.stderr
        rec = next(
            r for r in json.loads((tmp_path / f"{dtype}.json").read_text())["tensors"] if r["name"] == name
        )
        assert rec["route"] == route, rec
        got = f64(load_dir(out)[name])
        assert np.abs(got - ref).max() <= unit * np.abs(ref).max() + REL * np.abs(ref).max(), dtype


def test_nonfinite_input_is_refused(tmp_path):
    base, fts = odd_shapes(tmp_path, n=2)
    sd = load_file(str(fts[0] / "model.safetensors"))
    sd["model.layers.0.mlp.down_proj.weight"][3, 1] = float("nan")
    write_checkpoint(fts[0], list(sd.items()), config=CFG.to_hf("float32"))
    res = run_dghard("merge", "--method", "tsv", "--min-numel", "0", base, *fts, "--out", tmp_path / "o")
    assert res.returncode == 2 and "NaN" in res.stderr, res.stderr
    with pytest.raises(InputError):
        merge(base, fts, tmp_path / "o2", opts("tsv", policy=_policy(min_numel=0)))


@pytest.mark.parametrize("method", ["tsv", "iso-c", "iso-cts"])
def test_a_matrix_whose_gram_cannot_fit_is_refused_before_any_allocation(tmp_path, method):
    """A 10^6 × 10^6 bf16 matrix in a sparse file: its 8 TB Gram matrix is refused from the shape."""
    import os

    rows = cols = 10**6
    name = "model.layers.0.mlp.up_proj.weight"
    for d in ("base", "ft"):
        (tmp_path / d).mkdir()
        head = json.dumps(
            {name: {"dtype": "BF16", "shape": [rows, cols], "data_offsets": [0, 2 * rows * cols]}}
        )
        raw = head.encode() + b" " * (-len(head) % 8)
        p = tmp_path / d / "model.safetensors"
        p.write_bytes(len(raw).to_bytes(8, "little") + raw)
        try:
            os.truncate(p, p.stat().st_size + 2 * rows * cols)
        except OSError:
            pytest.skip("the file system holds no 2 TB sparse files")
    res = run_dghard(
        "merge", "--method", method, tmp_path / "base", tmp_path / "ft", "--out", tmp_path / "o", "--quiet",
        timeout=120,
    )  # fmt: skip
    assert res.returncode == 2 and "needs about" in res.stderr and "Gram matrix" in res.stderr, res.stderr[
        -500:
    ]


def test_low_rank_deltas_flatten_over_their_rank(tmp_path):
    """Rank-4 task vectors: Iso-C's flat spectrum covers rank(Σ Δ_i) = 12 directions (σ̄ = their
    mean), not min(m, n); TSV keeps each task's 4 non-zero triplets."""
    name = "model.layers.0.self_attn.q_proj.weight"
    g = torch.Generator().manual_seed(9)
    write_checkpoint(tmp_path / "b", [(name, torch.zeros((48, 48)))], config=CFG.to_hf("float32"))
    fts = []
    for i in range(3):
        low = torch.randn((48, 4), generator=g, dtype=torch.float64) @ torch.randn(
            (4, 48), generator=g, dtype=torch.float64
        )
        write_checkpoint(tmp_path / f"f{i}", [(name, low.to(torch.float32))], config=CFG.to_hf("float32"))
        fts.append(tmp_path / f"f{i}")
    b, f = as64(load_dir(tmp_path / "b")), [as64(load_dir(x)) for x in fts]
    for method, rank in (("iso-c", 12), ("tsv", 12), ("iso-cts", 12)):
        doc, got = run(tmp_path / "b", fts, tmp_path / method, method)
        assert_close(got, reference(method, b, f), b)
        assert doc["tensors"][0]["rank"] == rank


@pytest.mark.parametrize("method", ["tsv", "iso-c", "iso-cts"])
def test_lora_adapters_merge_over_their_exact_rank(tmp_path, method):
    """Two rank-4 LoRA adapters (read as BASE + B·A computed in float32): the rounding of that
    computation is not a direction — the merged update has rank 8 and matches the reference on
    the exact deltas (α/r)·B·A (before the noise floor, every one of these was refused: the flat
    spectrum divided by rounding noise)."""
    from dghard_cli.testing.synthetic_lora import make_adapter

    cfg = ArchConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=1, vocab_size=256)
    base, _ = make_pair(tmp_path / "m", cfg, seed=0)
    ads = []
    for seed in (1, 2):
        d, tensors, conf = make_adapter(
            tmp_path / f"ad{seed}", cfg, r=4, targets=("q_proj", "up_proj"), seed=seed
        )
        ads.append((d, tensors, conf))
    doc, got = run(base, [a[0] for a in ads], tmp_path / "o", method, lora=LoraOutputOptions(format="full"))
    b = as64(load_dir(base))
    for mod in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj"):
        name = f"{mod}.weight"
        deltas = []
        for _, tensors, conf in ads:
            a = f64(next(v for k, v in tensors.items() if k.endswith(f"{mod}.lora_A.weight")))
            bb = f64(next(v for k, v in tensors.items() if k.endswith(f"{mod}.lora_B.weight")))
            deltas.append(conf["lora_alpha"] / conf["r"] * (bb @ a))
        ref = {name: b[name] + REFS[method](b[name], [b[name] + d for d in deltas])}
        assert_close({name: got[name]}, ref, {name: b[name]}, unit=4 * U32)
        rec = next(r for r in doc["tensors"] if r["name"] == name)
        assert rec["rank"] == 8 and rec["error_bound"] < 1e-12


@pytest.mark.parametrize("method", ["iso-c", "tsv"])
def test_no_output_dtype_is_refused_for_accuracy(tmp_path, method):
    """Singular values from 1 down to 3e-8: the Gram route's bound (≈ 0.2) exceeds even bf16's
    resolution, and the merge was refused for every dtype ("--exclude the tensor"). The accurate
    route meets float32's and bf16's: the directions below the numerical-rank floor
    (σ² ≤ 4·M·ε·σ_max², as on the Gram route) are zeros, the rest merged as the formula says."""
    from dghard_cli.methods.subspace import coarser_output_hint

    g = torch.Generator().manual_seed(3)
    u = torch.linalg.qr(torch.randn((64, 32), generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn((32, 32), generator=g, dtype=torch.float64))[0]
    delta = (u * torch.logspace(0, -7.5, 32, dtype=torch.float64)) @ v.T
    name = "model.layers.0.mlp.up_proj.weight"
    zero = torch.zeros((64, 32), dtype=torch.float32)
    write_checkpoint(tmp_path / "b", [(name, zero)], config=CFG.to_hf("float32"))
    write_checkpoint(tmp_path / "f", [(name, delta.to(torch.float32))], config=CFG.to_hf("float32"))
    d = f64(load_dir(tmp_path / "f")[name])
    p, s, qt = np.linalg.svd(d, full_matrices=False)
    r = int(np.count_nonzero(s**2 > 4 * 32 * 2.0**-52 * s[0] ** 2))
    assert 8 < r < 32  # the floor cuts some directions and keeps those the Gram route could not
    ref = s[:r].mean() * p[:, :r] @ qt[:r] if method == "iso-c" else (p[:, :r] * s[:r]) @ qt[:r]
    kw = {"tsv_rank": 32} if method == "tsv" else {}
    for dtype, unit in (("F32", U32), ("BF16", UBF16)):
        doc, got = run(
            tmp_path / "b", [tmp_path / "f"], tmp_path / dtype, method, policy=_policy(out_dtype=dtype), **kw
        )
        rec = next(x for x in doc["tensors"] if x["name"] == name)
        assert rec["route"] == "svd-float64" and rec["rank"] == r and rec["gram_error_bound"] > UBF16, rec
        assert np.abs(f64(got[name]) - ref).max() <= (unit + REL) * np.abs(ref).max(), dtype
    assert "--dtype bf16" in coarser_output_hint("F32", 1e-3)
    assert "--dtype bf16" in coarser_output_hint("F16", 1e-3)
    assert "--dtype bf16" not in coarser_output_hint("F32", 1e-1)  # bf16 would not meet it either
    assert "--dtype bf16" not in coarser_output_hint("BF16", 1e-3)


def test_the_accurate_route_is_refused_in_one_line_where_it_cannot_fit(tmp_path, monkeypatch):
    """The accurate route holds the whole matrix in float64: where that exceeds the machine's
    memory the tensor is refused before any output, naming it, the route and what to do."""
    import dghard_cli.engine.working_memory as wm

    delta = ill_conditioned_delta()
    name = "model.layers.0.mlp.up_proj.weight"
    write_checkpoint(tmp_path / "b", [(name, torch.zeros((64, 32)))], config=CFG.to_hf("float32"))
    write_checkpoint(tmp_path / "f", [(name, delta.to(torch.float32))], config=CFG.to_hf("float32"))
    # room for the Gram route's spectrum (checked before writing), not for the accurate route
    monkeypatch.setattr(wm, "machine_memory", lambda device=None: wm.spectral_bytes(64, 32))
    with pytest.raises(InputError) as e:
        run(tmp_path / "b", [tmp_path / "f"], tmp_path / "o", "iso-c")
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and f"tensor {name!r}" in msg and "accurate SVD route" in msg, msg
    assert "--dtype bf16" in msg and not (tmp_path / "o").exists()
