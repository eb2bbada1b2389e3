"""Layer-wise strengths (LiNeS: ``--lines A,B``, ``--layer-strengths``) in repair and merge,
against independent float64 numpy references written here: W_base + λ(ℓ)·Δ per tensor, composed
with Δ* from a float64 SVD (DG-Hard, shrinkers), and with the merged task vectors (TIES, DARE,
task arithmetic, WiSE-FT, DG-Hard merge), on generated sharded checkpoints with Llama, Qwen2,
GPT-2 and BERT tensor names, in float32 and bfloat16."""

from __future__ import annotations

import json
import math

import merge_reference as M
import numpy as np
import pytest
import torch
from conftest import f64, load_dir, run_dghard
from reference import ref_filter

from dghard_cli import MergeOptions, PolicyOptions, RepairOptions, RunOptions, ShrinkSpec, merge, repair
from dghard_cli.errors import InputError
from dghard_cli.methods import dare as dare_mod
from dghard_cli.schedule.spec import (
    LayerSchedule,
    parse_layer_strengths,
    parse_lines,
    schedule_from_recipe,
)
from dghard_cli.testing.synthetic import ARCHITECTURES, ArchConfig, make_pair, write_checkpoint

L = 3
CFGS = {
    arch: ArchConfig(
        model_type=arch,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=L,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=80,
        max_positions=40,
    )
    for arch in ("llama", "qwen2", "gpt2", "bert")
}
RUN = RunOptions(device="cpu", quiet=True)

# -- the reference: where each generated tensor sits, written out per layout ---------------------

EMBED_PREFIXES = ("model.embed_tokens.", "transformer.wte.", "transformer.wpe.", "bert.embeddings.")
HEAD_PREFIXES = ("model.norm.", "lm_head.", "transformer.ln_f.", "bert.pooler.")
BLOCK_PREFIXES = ("model.layers.", "transformer.h.", "bert.encoder.layer.")


def ref_place(name: str):
    if name.startswith(EMBED_PREFIXES):
        return "embed"
    if name.startswith(HEAD_PREFIXES):
        return "head"
    for p in BLOCK_PREFIXES:
        if name.startswith(p):
            return int(name[len(p) :].split(".")[0])
    raise AssertionError(f"the test layouts have no tensor {name}")


def ref_lines(a: float, b: float, n: int = L):
    """λ for a place, from the formula: A + B·ℓ/(L−1); embeddings A, head A + B."""

    def lam(place) -> float:
        if place == "embed":
            return a
        if place == "head":
            return a + b
        return a + b * place / (n - 1)

    return lam


def ref_groups(spec: dict):
    """λ for a place from an explicit {embed, head, (lo, hi)} table."""

    def lam(place) -> float:
        if place in ("embed", "head"):
            return spec[place]
        (val,) = [v for k, v in spec.items() if isinstance(k, tuple) and k[0] <= place <= k[1]]
        return val

    return lam


def ulp(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """The spacing of ``dtype`` at |x| (normal range)."""
    mant = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[dtype]
    ax = np.maximum(np.abs(x), 1e-30)
    return 2.0 ** (np.floor(np.log2(ax)) - mant)


def assert_rounded(out: torch.Tensor, ref: np.ndarray, name: str) -> None:
    """``out`` is the float64 reference rounded once to ``out``'s dtype (to one unit in the last
    place where the reference lies within rounding noise of a midpoint)."""
    r = torch.from_numpy(np.ascontiguousarray(ref)).to(out.dtype)
    assert out.shape == r.shape, name
    if torch.equal(out, r):
        return
    o, rr = f64(out), f64(r)
    diff = np.abs(o - rr)
    assert np.all(diff <= ulp(rr, out.dtype)), (name, float(diff.max()))
    assert np.mean(diff > 0) <= 1e-3, (name, float(np.mean(diff > 0)))


def pair(tmp_path, arch: str, dtype: str, **kw):
    base, ft = make_pair(tmp_path, CFGS[arch], dtype=dtype, base_shards=2, ft_shards=3, seed=5, **kw)
    return base, ft, load_dir(base), load_dir(ft)


def is_matrix(name: str, t: torch.Tensor, min_numel: int = 1024) -> bool:
    """Repair's eligibility, from its definition: 2-D floating, ≥ min_numel, both sides ≥ 2."""
    return t.ndim == 2 and t.numel() >= min_numel and min(t.shape) >= 2


# -- repair: the schedule alone ---------------------------------------------------------------


@pytest.mark.parametrize(
    "arch, dtype", [("llama", "float32"), ("qwen2", "bfloat16"), ("gpt2", "float32"), ("bert", "bfloat16")]
)
def test_lines_alone_matches_reference(tmp_path, arch, dtype):
    base, ft, b, f = pair(tmp_path, arch, dtype)
    out = tmp_path / "out"
    doc = repair(base, ft, out, RepairOptions(spec=None, schedule=LayerSchedule(0.25, 0.5), run=RUN))
    o = load_dir(out)
    lam = ref_lines(0.25, 0.5)
    assert set(o) == set(f)
    recs = {r["name"]: r for r in doc["tensors"]}
    seen = set()
    for name, t in o.items():
        place = ref_place(name)
        ref = f64(b[name]) + lam(place) * (f64(f[name]) - f64(b[name]))
        assert_rounded(t, ref, name)
        assert t.dtype == f[name].dtype
        rec = recs[name]
        assert rec["action"] == "method" and rec["layer"] == place, name
        assert rec["layer_strength"] == pytest.approx(lam(place), abs=1e-15)
        seen.add(place)
    assert seen == {"embed", "head", 0, 1, 2}
    assert doc["method"] == "lines" and doc["parameters"]["lines"] == [0.25, 0.5]
    ls = doc["layer_strengths"]
    assert ls["num_layers"] == L and ls["embed"] == 0.25 and ls["head"] == 0.75
    assert ls["layers"] == pytest.approx([0.25, 0.5, 0.75])
    assert ls["summary"] == "embed 0.25 | 0: 0.25, 1: 0.5, 2: 0.75 | head 0.75"
    on_disk = json.loads((out / "dghard_report.json").read_text())
    assert on_disk["layer_strengths"] == ls and on_disk["tensors"] == doc["tensors"]
    assert "layer strengths λ: embed 0.25" in (out / "README.md").read_text()


def test_extreme_strengths_give_base_and_fine_tune_bit_for_bit(tmp_path):
    base, ft, b, f = pair(tmp_path, "qwen2", "bfloat16")
    repair(base, ft, tmp_path / "zero", RepairOptions(spec=None, schedule=parse_lines("0,0"), run=RUN))
    repair(base, ft, tmp_path / "one", RepairOptions(spec=None, schedule=parse_lines("1,0"), run=RUN))
    zero, one = load_dir(tmp_path / "zero"), load_dir(tmp_path / "one")
    for name in f:
        assert torch.equal(zero[name].view(torch.uint8), b[name].view(torch.uint8)), name
        assert torch.equal(one[name].view(torch.uint8), f[name].view(torch.uint8)), name


def test_dg_hard_under_lines_1_0_writes_dg_hard_bytes(tmp_path):
    base, ft, _, _ = pair(tmp_path, "llama", "bfloat16")
    repair(base, ft, tmp_path / "plain", RepairOptions(run=RUN))
    repair(base, ft, tmp_path / "lines", RepairOptions(schedule=parse_lines("1,0"), run=RUN))
    shards = sorted(p.name for p in (tmp_path / "plain").glob("*.safetensors"))
    assert shards == sorted(p.name for p in (tmp_path / "lines").glob("*.safetensors"))
    for s in shards:
        assert (tmp_path / "plain" / s).read_bytes() == (tmp_path / "lines" / s).read_bytes(), s


# -- repair: composed with the spectral methods -------------------------------------------------


@pytest.mark.parametrize(
    "arch, dtype, shrink, block_bytes",
    [
        ("llama", "float32", {"shrink": "hard"}, None),
        ("llama", "float32", {"shrink": "hard"}, 4096),  # tall matrices in many row blocks
        ("gpt2", "bfloat16", {"shrink": "hard", "scale": 0.8}, None),
        ("bert", "float32", {"shrink": "soft"}, None),
        ("qwen2", "bfloat16", {"shrink": "optimal"}, 4096),
    ],
)
def test_lines_on_top_of_spectral_methods(tmp_path, arch, dtype, shrink, block_bytes):
    base, ft, b, f = pair(tmp_path, arch, dtype)
    out = tmp_path / "out"
    opts = RepairOptions(
        spec=ShrinkSpec(**shrink), schedule=LayerSchedule(0.2, 0.6), run=RUN, block_bytes=block_bytes
    )
    doc = repair(base, ft, out, opts)
    o = load_dir(out)
    lam = ref_lines(0.2, 0.6)
    recs = {r["name"]: r for r in doc["tensors"]}
    kw = {k: v for k, v in shrink.items()}
    n_matrices = 0
    for name, t in o.items():
        d = f64(f[name]) - f64(b[name])
        rec = recs[name]
        if is_matrix(name, f[name]):
            n_matrices += 1
            filtered, rank, _ = ref_filter(d, **kw)
            assert rec["action"] == "method" and rec["rank_kept"] == rank, name
        else:  # norms, biases, small: under a schedule W_base + λ·Δ, not the fine-tune's value
            filtered = d
            assert rec["action"] == "scaled" and rec["reason"] in ("1-d", "small"), name
        assert_rounded(t, f64(b[name]) + lam(ref_place(name)) * filtered, name)
        assert rec["layer_strength"] == pytest.approx(lam(ref_place(name)), abs=1e-15)
    assert n_matrices >= 3 * L
    assert doc["parameters"]["shrink"] == shrink["shrink"] and doc["parameters"]["lines"] == [0.2, 0.6]
    assert doc["summary"]["actions"]["scaled"] > 0 and doc["summary"]["energy_kept"] is not None


def test_per_group_strengths_and_yaml_file(tmp_path):
    base, ft, b, f = pair(tmp_path, "bert", "bfloat16")
    spec = {"embed": 0.1, (0, 1): 0.3, (2, 2): 0.9, "head": 1.0}
    lam = ref_groups(spec)
    text = "embed=0.1,0-1=0.3,2=0.9,head=1"
    yml = tmp_path / "strengths.yaml"
    yml.write_text("embed: 0.1\n0-1: 0.3\n2: 0.9\nhead: 1\n")
    for i, given in enumerate((text, str(yml))):
        out = tmp_path / f"out{i}"
        doc = repair(base, ft, out, RepairOptions(spec=None, schedule=parse_layer_strengths(given), run=RUN))
        o = load_dir(out)
        for name, t in o.items():
            ref = f64(b[name]) + lam(ref_place(name)) * (f64(f[name]) - f64(b[name]))
            assert_rounded(t, ref, name)
        assert doc["method"] == "layer-strengths"
        assert doc["parameters"]["layer_strengths"] == "embed=0.1,0-1=0.3,2=0.9,head=1.0"
        assert doc["layer_strengths"]["layers"] == [0.3, 0.3, 0.9]
    a, c = tmp_path / "out0", tmp_path / "out1"
    for p in a.glob("*.safetensors"):
        assert p.read_bytes() == (c / p.name).read_bytes()


def test_resized_vocabulary_schedules_the_shared_rows_only(tmp_path):
    base, ft, b, f = pair(tmp_path, "llama", "float32", ft_vocab=CFGS["llama"].vocab_size + 16)
    out = tmp_path / "out"
    doc = repair(base, ft, out, RepairOptions(schedule=LayerSchedule(0.3, 0.4), run=RUN))
    o = load_dir(out)
    lam = ref_lines(0.3, 0.4)
    recs = {r["name"]: r for r in doc["tensors"]}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        n = b[name].shape[0]
        d = f64(f[name][:n]) - f64(b[name])
        filtered, rank, _ = ref_filter(d)
        assert recs[name]["action"] == "resized" and recs[name]["rank_kept"] == rank
        assert_rounded(o[name][:n], f64(b[name]) + lam(ref_place(name)) * filtered, name)
        assert torch.equal(o[name][n:], f[name][n:]), name  # new rows: the fine-tune's, bit for bit


def test_tied_embeddings_take_the_embeddings_strength(tmp_path):
    cfg = CFGS["llama"]
    layout = ARCHITECTURES["llama"](cfg)
    g = torch.Generator().manual_seed(3)
    base_t, ft_t = [], []
    emb_b = 0.02 * torch.randn((cfg.vocab_size, cfg.hidden_size), generator=g, dtype=torch.float64)
    emb_f = emb_b + 0.01 * torch.randn(emb_b.shape, generator=g, dtype=torch.float64)
    for name, shape in layout:
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            bb, ff = emb_b, emb_f
        else:
            bb = 0.02 * torch.randn(shape, generator=g, dtype=torch.float64)
            ff = bb + 0.005 * torch.randn(shape, generator=g, dtype=torch.float64)
        base_t.append((name, bb.float()))
        ft_t.append((name, ff.float()))
    config = {**cfg.to_hf("float32"), "tie_word_embeddings": True}
    write_checkpoint(tmp_path / "base", base_t, shards=1, config=config)
    write_checkpoint(tmp_path / "ft", ft_t, shards=2, config=config)
    out = tmp_path / "out"
    doc = repair(
        tmp_path / "base",
        tmp_path / "ft",
        out,
        RepairOptions(spec=None, schedule=LayerSchedule(0.2, 0.7), run=RUN),
    )
    o = load_dir(out)
    ref = f64(emb_b.float()) + 0.2 * (f64(emb_f.float()) - f64(emb_b.float()))
    assert_rounded(o["model.embed_tokens.weight"], ref, "embed")
    assert torch.equal(o["lm_head.weight"], o["model.embed_tokens.weight"])
    recs = {r["name"]: r for r in doc["tensors"]}
    assert recs["lm_head.weight"]["action"] == "tied"
    assert (
        recs["lm_head.weight"]["layer_strength"] == recs["model.embed_tokens.weight"]["layer_strength"] == 0.2
    )


def test_excluded_and_ft_only_tensors_keep_the_fine_tune(tmp_path):
    base, ft, b, f = pair(tmp_path, "llama", "float32")
    out = tmp_path / "out"
    pol = PolicyOptions(exclude=["lm_head"])
    doc = repair(
        base, ft, out, RepairOptions(spec=None, schedule=LayerSchedule(0.5, 0.0), policy=pol, run=RUN)
    )
    o = load_dir(out)
    rec = {r["name"]: r for r in doc["tensors"]}["lm_head.weight"]
    assert rec["action"] == "kept-ft" and rec["reason"] == "excluded" and "layer_strength" not in rec
    assert torch.equal(o["lm_head.weight"], f["lm_head.weight"])


def test_nonfinite_inputs_with_allow_nonfinite_keep_the_fine_tune(tmp_path):
    base, ft, b, f = pair(tmp_path, "llama", "float32")
    name = "model.layers.1.input_layernorm.weight"
    bad = dict(load_dir(base))
    bad[name] = bad[name].clone()
    bad[name][3] = float("nan")
    write_checkpoint(tmp_path / "nanbase", list(bad.items()), shards=1, config=CFGS["llama"].to_hf("float32"))
    with pytest.raises(InputError, match=f"tensor '{name}'.*NaN"):
        repair(
            tmp_path / "nanbase",
            ft,
            tmp_path / "o1",
            RepairOptions(spec=None, schedule=LayerSchedule(0.5, 0.2), run=RUN),
        )
    assert not (tmp_path / "o1").exists()
    run = RunOptions(device="cpu", quiet=True, allow_nonfinite=True)
    doc = repair(
        tmp_path / "nanbase",
        ft,
        tmp_path / "o2",
        RepairOptions(spec=None, schedule=LayerSchedule(0.5, 0.2), run=run),
    )
    rec = {r["name"]: r for r in doc["tensors"]}[name]
    assert rec["action"] == "kept-ft" and rec["reason"] == "nonfinite" and "layer_strength" not in rec
    assert torch.equal(load_dir(tmp_path / "o2")[name], f[name])


# -- merge ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def merge_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lines-merge")
    out = {}
    for arch in ("llama", "gpt2"):
        base, ft1 = make_pair(root / arch / "a", CFGS[arch], ft_shards=3, seed=9)
        _, ft2 = make_pair(root / arch / "b", CFGS[arch], ft_shards=1, seed=9, delta_seed=21)
        out[arch] = {
            "base_dir": base,
            "ft_dirs": [ft1, ft2],
            "base": load_dir(base),
            "fts": [load_dir(ft1), load_dir(ft2)],
        }
    return out


def _dg_hard_merge_ref(name, b, fs, w, lam):
    if b.ndim == 2 and b.size >= 1024 and min(b.shape) >= 2:
        return b + lam * sum(wi * ref_filter(f - b)[0] for wi, f in zip(w, fs, strict=True))
    return M.ref_task_arithmetic(b, fs, w, lam)


MERGES = [
    (
        "task-arithmetic",
        dict(weights=[1.0, -0.5], lam=0.9),
        lambda n, b, fs: M.ref_task_arithmetic(b, fs, [1.0, -0.5], 0.9),
    ),
    ("ties", dict(weights=[1.0, 0.5], density=0.3), lambda n, b, fs: M.ref_ties(b, fs, [1.0, 0.5], 0.3, 1.0)),
    (
        "dare-linear",
        dict(density=0.4, seed=3),
        lambda n, b, fs: M.ref_dare(b, fs, [1.0, 1.0], 0.4, 1.0, 3, n, dare_mod.CHUNK, ties=False),
    ),
    (
        "dare-ties",
        dict(density=0.5, seed=1, weights=[1.0, 2.0]),
        lambda n, b, fs: M.ref_dare(b, fs, [1.0, 2.0], 0.5, 1.0, 1, n, dare_mod.CHUNK, ties=True),
    ),
    ("dg-hard", dict(weights=[1.0, 0.5]), lambda n, b, fs: _dg_hard_merge_ref(n, b, fs, [1.0, 0.5], 1.0)),
    ("wise-ft", dict(alpha=0.6), lambda n, b, fs: M.ref_wise_ft(b, fs[0], 0.6)),
]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("method, kw, ref_fn", MERGES, ids=[m[0] for m in MERGES])
def test_lines_on_merged_task_vectors(merge_models, tmp_path, arch, method, kw, ref_fn):
    mm = merge_models[arch]
    n = 1 if method == "wise-ft" else 2
    out = tmp_path / "out"
    opts = MergeOptions(method=method, run=RUN, schedule=LayerSchedule(0.3, 0.6), **kw)
    doc = merge(mm["base_dir"], mm["ft_dirs"][:n], out, opts)
    o = load_dir(out)
    lam = ref_lines(0.3, 0.6)
    recs = {r["name"]: r for r in doc["tensors"]}
    for name, t in o.items():
        b = f64(mm["base"][name])
        merged = ref_fn(name, b, [f64(f[name]) for f in mm["fts"][:n]])
        assert_rounded(t, b + lam(ref_place(name)) * (merged - b), name)
        assert recs[name]["layer_strength"] == pytest.approx(lam(ref_place(name)), abs=1e-15)
    assert doc["parameters"]["lines"] == [0.3, 0.6] and doc["layer_strengths"]["num_layers"] == L


def test_merge_recipe_lines_key(merge_models, tmp_path):
    mm = merge_models["llama"]
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"method: ties\nbase: {mm['base_dir']}\nmodels:\n  - {mm['ft_dirs'][0]}\n  - {mm['ft_dirs'][1]}\n"
        f"density: 0.3\nlines: [0.3, 0.6]\nout: {tmp_path / 'r'}\n"
    )
    r = run_dghard("merge", "--config", recipe, "--quiet", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    r = run_dghard(
        "merge",
        "--method",
        "ties",
        "--density",
        "0.3",
        "--lines",
        "0.3,0.6",
        mm["base_dir"],
        *mm["ft_dirs"],
        "--out",
        tmp_path / "c",
        "--quiet",
        "--device",
        "cpu",
    )
    assert r.returncode == 0, r.stderr
    for p in (tmp_path / "c").glob("*.safetensors"):
        assert p.read_bytes() == (tmp_path / "r" / p.name).read_bytes()
    rep = json.loads((tmp_path / "r" / "dghard_report.json").read_text())
    assert rep["parameters"]["lines"] == [0.3, 0.6]
    # layer_strengths in a recipe: a mapping
    recipe.write_text(
        recipe.read_text().replace("lines: [0.3, 0.6]", "layer_strengths: {embed: 0.2, 0-2: 0.5, head: 1}")
    )
    sched = schedule_from_recipe({"layer_strengths": {"embed": 0.2, "0-2": 0.5, "head": 1}}, "recipe r.yaml")
    assert sched.spec == "embed=0.2,0-2=0.5,head=1.0"
    r = run_dghard("merge", "--config", recipe, "--quiet", "--device", "cpu", "--overwrite")
    assert r.returncode == 0, r.stderr


# -- the command line, its output and its errors -----------------------------------------------


def test_cli_prints_the_strengths_and_composes_only_when_asked(tmp_path):
    base, ft, _, _ = pair(tmp_path, "llama", "bfloat16")
    r = run_dghard("repair", base, ft, tmp_path / "a", "--lines", "0.2,0.6", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "λ per layer  embed 0.2 | 0: 0.2, 1: 0.5, 2: 0.8 | head 0.8" in r.stdout
    rep = json.loads((tmp_path / "a" / "dghard_report.json").read_text())
    assert rep["method"] == "lines" and "shrink" not in rep["parameters"]
    r = run_dghard("repair", base, ft, tmp_path / "b", "--lines", "0.2,0.6", "--shrink", "hard", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["method"] == "dg-hard" and doc["parameters"]["lines"] == [0.2, 0.6]
    r = run_dghard("repair", base, ft, tmp_path / "c", "--lines", "0.2,0.6", "--scale", "2", "--json")
    assert json.loads(r.stdout)["parameters"]["scale"] == 2.0  # --scale alone implies the hard cut
    r = run_dghard(
        "repair", base, ft, tmp_path / "d", "--layer-strengths", "embed=0,0-2=0.5,head=1", "--dry-run", "-v"
    )
    assert r.returncode == 0, r.stderr
    assert "λ per layer: embed 0 | 0-2: 0.5 | head 1" in r.stdout and "0.5 (1)" in r.stdout
    assert not (tmp_path / "d").exists()


@pytest.fixture(scope="module")
def shared_pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("lines-errors"), CFGS["llama"], ft_shards=2, seed=5)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lines", "0.2"], "expected two numbers A,B"),
        (["--lines", "0.2,x"], "'x' is not a number"),
        (["--lines", "0.2,0.6", "--layer-strengths", "embed=1,0-2=1,head=1"], "not both"),
        (["--layer-strengths", "embed=0.2,0=0.3,2=0.5,head=1"], "block 1 is not covered"),
        (["--layer-strengths", "embed=0.2,0-1=0.3,1-2=0.5,head=1"], "block 1 is covered twice (0-1 and 1-2)"),
        (["--layer-strengths", "embed=0.2,0-3=0.3,head=1"], "goes past the last block 2"),
        (["--layer-strengths", "0-2=0.3,head=1"], "no strength for the embeddings"),
        (["--layer-strengths", "embed=0.2,0-2=0.3"], "no strength for the final norm and head"),
        (["--layer-strengths", "embed=0.2,tail=3"], "'tail' is not a group"),
        (["--layer-strengths", "missing.yaml"], "'missing.yaml': no such file, and not GROUP=STRENGTH"),
    ],
)
def test_bad_schedules_are_one_line_errors(shared_pair, tmp_path, args, message):
    from typer.testing import CliRunner

    from dghard_cli.cli import app

    base, ft = shared_pair
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["repair", str(base), str(ft), str(out), *args])
    assert res.exit_code == 2, res.output
    text = " ".join((res.output + (res.stderr if hasattr(res, "stderr") else "")).split())
    assert message in text and "Traceback" not in text
    assert not out.exists() and not list(tmp_path.glob(".*partial"))


def test_a_bad_schedule_exits_2_from_the_real_command_line(shared_pair, tmp_path):
    base, ft = shared_pair
    r = run_dghard("repair", base, ft, tmp_path / "out", "--layer-strengths", "embed=0.2,0=0.3,2=0.5,head=1")
    assert r.returncode == 2 and r.stderr.startswith(
        "dghard: error: --layer-strengths: block 1 is not covered"
    )
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_unreadable_depth_and_disagreeing_config_are_errors(tmp_path):
    base, ft, b, f = pair(tmp_path, "llama", "float32")
    cfg = CFGS["llama"].to_hf("float32")
    odd = dict(b)
    odd["model.adapter_gate.weight"] = torch.ones(8)
    write_checkpoint(tmp_path / "b2", list(odd.items()), shards=1, config=cfg)
    odd_f = dict(f)
    odd_f["model.adapter_gate.weight"] = torch.full((8,), 2.0)
    write_checkpoint(tmp_path / "f2", list(odd_f.items()), shards=2, config=cfg)
    r = run_dghard("repair", tmp_path / "b2", tmp_path / "f2", tmp_path / "o", "--lines", "0.2,0.6")
    assert (
        r.returncode == 2 and "cannot tell the layer depth of tensor 'model.adapter_gate.weight'" in r.stderr
    )
    assert "--exclude" in r.stderr and not (tmp_path / "o").exists()
    # excluded, it keeps the fine-tune's value and needs no depth
    r = run_dghard(
        "repair",
        tmp_path / "b2",
        tmp_path / "f2",
        tmp_path / "o",
        "--lines",
        "0.2,0.6",
        "--exclude",
        "adapter_gate",
    )
    assert r.returncode == 0, r.stderr

    (ft / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 4}))
    r = run_dghard("repair", base, ft, tmp_path / "o2", "--lines", "0.2,0.6")
    assert r.returncode == 2
    assert "num_hidden_layers = 4 but there are blocks 0-2 in the tensor names" in r.stderr
    r = run_dghard("merge", "--method", "ties", "--lines", "0.2,0.6", base, ft, "--out", tmp_path / "o3")
    assert r.returncode == 2 and "num_hidden_layers = 4" in r.stderr
    assert not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()


def test_schedule_parsing_units():
    s = parse_lines(" 0.25 , -0.5 ")
    assert (s.alpha, s.beta, s.spec, s.argv()) == (0.25, -0.5, "0.25,-0.5", ["--lines", "0.25,-0.5"])
    g = parse_layer_strengths("head=1, embed = 0.2, 0-7=0.3,8=0.5")
    assert g.groups == (("head", 1.0), ("embed", 0.2), ((0, 7), 0.3), ((8, 8), 0.5))
    for bad, msg in [
        ("embed=0.2,,head=1", "empty item"),
        ("embed=0.2,embed=0.3", "embed is given twice"),
        ("embed=0.2,5-3=1", "runs backwards"),
        ("embed=inf", "must be finite"),
        ("embed:0.2", "no such file"),
    ]:
        with pytest.raises(InputError, match=msg):
            parse_layer_strengths(bad)
    with pytest.raises(InputError, match="two numbers"):
        schedule_from_recipe({"lines": [1, 2, 3]}, "recipe x")
    with pytest.raises(InputError, match="not both"):
        schedule_from_recipe({"lines": "1,2", "layer_strengths": "embed=1"}, "recipe x")
    assert math.isclose(schedule_from_recipe({"lines": "0.1,0.2"}, "r").beta, 0.2)


@pytest.mark.parametrize("piece_elems, chunk_elems", [(13, 10), (5, 1 << 20), (1 << 20, 7)])
def test_schedule_on_blocks_that_split_rows(tmp_path, piece_elems, chunk_elems):
    """The wrapped operation may yield pieces of the flattened tensor that do not end on a row
    (passthrough streams a 1×N matrix that way); the schedule follows the elements, not rows."""
    from dghard_cli.engine.ops import JobInputs, passthrough
    from dghard_cli.engine.plan import TensorJob
    from dghard_cli.io.checkpoint import Checkpoint
    from dghard_cli.schedule.op import ScheduledOp

    base, ft, b, f = pair(tmp_path, "llama", "float32")
    name = "model.layers.1.mlp.up_proj.weight"
    bck, fck = Checkpoint(base), Checkpoint(ft)
    try:
        bi, fi = bck.tensors[name], fck.tensors[name]
        job = TensorJob(name, "method", None, fi.shape, "F32", base=bi, fts=[fi], layer=1, strength=0.4)
        assert fi.shape[1] % min(piece_elems, chunk_elems) != 0  # pieces end inside rows
        op = ScheduledOp(lambda j, s, r: passthrough(j, s, r, chunk_bytes=8 * piece_elems), 8 * chunk_elems)
        blocks = list(op(job, JobInputs(job, None), {}))
    finally:
        bck.close()
        fck.close()
    out = torch.cat([blk.reshape(-1) for blk in blocks]).reshape(fi.shape)
    assert_rounded(out, f64(b[name]) + 0.4 * (f64(f[name]) - f64(b[name])), name)
