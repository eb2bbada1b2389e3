"""`dghard repair` end to end on generated checkpoints, against a float64 numpy reference."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import f64, load_dir, run_dghard
from reference import ref_filter, rel
from safetensors.torch import save_file

from dghard_cli import MergeOptions, PolicyOptions, RepairOptions, RunOptions, ShrinkSpec, merge, repair
from dghard_cli.errors import InputError
from dghard_cli.testing.synthetic import ArchConfig, DeltaModel, make_pair, write_checkpoint

CFG = ArchConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, vocab_size=320)
FT_FILES = {
    "tokenizer_config.json": json.dumps({"model_max_length": 256, "origin": "ft"}),
    "tokenizer.json": json.dumps({"version": "1.0", "origin": "ft"}),
    "special_tokens_map.json": "{}",
    "generation_config.json": json.dumps({"max_new_tokens": 7, "origin": "ft"}),
    "chat_template.jinja": "{{ messages }} ft",
}
BASE_FILES = {k: v.replace("ft", "base") for k, v in FT_FILES.items()}


def check_against_reference(
    base: Path,
    ft: Path,
    out: Path,
    report: dict,
    *,
    tol: float,
    out_is_fp32: bool,
    shrink: dict | None = None,
) -> int:
    """Every output tensor vs the float64 reference; returns the number of method tensors."""
    b, f, o = load_dir(base), load_dir(ft), load_dir(out)
    assert set(o) == set(f)
    recs = {r["name"]: r for r in report["tensors"]}
    n = 0
    for name, t in o.items():
        rec = recs[name]
        if rec["action"] == "method":
            n += 1
            delta = f64(f[name]) - f64(b[name])
            ref_delta, rank, tau = ref_filter(delta, **(shrink or {}))
            ref = f64(b[name]) + ref_delta
            assert rec["rank_kept"] == rank, name
            assert abs(rec["tau"] - tau) <= 1e-9 * tau, name
            assert rel(f64(t), ref) <= tol, (name, rel(f64(t), ref))
            if out_is_fp32:
                assert t.dtype == torch.float32
        else:
            assert rec["action"] == "kept-ft", name
            assert t.dtype == f[name].dtype
            assert torch.equal(t.view(torch.uint8), f[name].view(torch.uint8)), name
    return n


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float32_repair_matches_reference(tmp_path, arch):
    cfg = ArchConfig(**{**CFG.__dict__, "model_type": arch})
    base, ft = make_pair(
        tmp_path,
        cfg,
        dtype="float32",
        base_shards=2,
        ft_shards=3,
        seed=1,
        ft_files=FT_FILES,
        base_files=BASE_FILES,
    )
    out = tmp_path / "out"
    report = repair(base, ft, out)
    n = check_against_reference(base, ft, out, report, tol=1e-5, out_is_fp32=True)
    assert n == 1 + 2 * 7 + 1  # embeddings, 7 matrices per layer, lm_head
    # layout mirrors FT: same shard names and which tensor lives where
    ft_index = json.loads((ft / "model.safetensors.index.json").read_text())
    out_index = json.loads((out / "model.safetensors.index.json").read_text())
    assert out_index["weight_map"] == ft_index["weight_map"]
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(
        p.name for p in ft.glob("*.safetensors")
    )
    # side files are the fine-tune's, not the base's
    for fname, text in FT_FILES.items():
        assert (out / fname).read_text() == text
    assert json.loads((out / "config.json").read_text()) == json.loads((ft / "config.json").read_text())
    assert (out / "README.md").read_text().startswith("---")
    on_disk = json.loads((out / "dghard_report.json").read_text())
    assert on_disk["schema_version"] == 1 and on_disk["summary"]["method_tensors"] == n
    assert not list(tmp_path.glob(".*dghard-partial"))


def test_bfloat16_repair_matches_reference_and_float32_output(tmp_path):
    base, ft = make_pair(tmp_path, CFG, dtype="bfloat16", ft_shards=3, seed=2)
    out = tmp_path / "out"
    report = repair(base, ft, out)
    # bf16 output: one rounding of the float64 result (unit roundoff 2^-8)
    check_against_reference(base, ft, out, report, tol=2.0**-8, out_is_fp32=False)
    out32 = tmp_path / "out32"
    report32 = repair(base, ft, out32, RepairOptions(policy=PolicyOptions(out_dtype="F32")))
    o = load_dir(out32)
    f = load_dir(ft)
    recs = {r["name"]: r for r in report32["tensors"]}
    for name, t in o.items():
        assert t.dtype == torch.float32
        if recs[name]["action"] == "method":
            b = load_dir(base)[name]
            ref = f64(b) + ref_filter(f64(f[name]) - f64(b))[0]
            assert rel(f64(t), ref) <= 1e-5
        else:
            assert torch.equal(t, f[name].float())


@pytest.mark.parametrize(
    "shrink",
    [
        {"shrink": "soft"},
        {"shrink": "optimal"},
        {"shrink": "twoknob", "a": 1.0, "b": 0.25},
        {"scale": 0.6},
        {"noise": "known", "sigma": 2e-3},
    ],
)
def test_other_shrinkers_end_to_end(tmp_path, shrink):
    base, ft = make_pair(tmp_path, CFG, dtype="float32", ft_shards=2, seed=3)
    out = tmp_path / "out"
    report = repair(base, ft, out, RepairOptions(spec=ShrinkSpec(**shrink)))
    ref_kw = {k: v for k, v in shrink.items() if k != "noise"}
    check_against_reference(base, ft, out, report, tol=1e-5, out_is_fp32=True, shrink=ref_kw)


def test_twoknob_reproduces_dg_hard_and_wise_ft(tmp_path):
    base, ft = make_pair(tmp_path, CFG, dtype="float32", ft_shards=1, seed=4)
    hard = load_dir(Path(repair(base, ft, tmp_path / "h")["output"]["path"]))
    tk = load_dir(
        Path(
            repair(base, ft, tmp_path / "t", RepairOptions(spec=ShrinkSpec(shrink="twoknob", a=1, b=0)))[
                "output"
            ]["path"]
        )
    )
    for k in hard:
        assert torch.equal(hard[k], tk[k])
    x = 0.3
    rep = repair(base, ft, tmp_path / "w", RepairOptions(spec=ShrinkSpec(shrink="twoknob", a=x, b=x)))
    w, b, f = load_dir(tmp_path / "w"), load_dir(base), load_dir(ft)
    # and what `dghard merge --method wise-ft --alpha x` writes (the sweep's WiSE-FT family)
    wise = load_dir(
        Path(merge(base, [ft], tmp_path / "m", MergeOptions(method="wise-ft", alpha=x))["output"]["path"])
    )
    for r in rep["tensors"]:
        if r["action"] == "method":
            ref = (1 - x) * f64(b[r["name"]]) + x * f64(f[r["name"]])
            assert rel(f64(w[r["name"]]), ref) < 1e-6
            assert rel(f64(w[r["name"]]), f64(wise[r["name"]])) < 1e-6


def test_cli_twoknob_one_zero_writes_the_dg_hard_bytes(tmp_path):
    base, ft = make_pair(tmp_path, CFG, dtype="bfloat16", ft_shards=2, seed=6)
    r1 = run_dghard("repair", base, ft, tmp_path / "hard", "--quiet")
    r2 = run_dghard(
        "repair", base, ft, tmp_path / "tk", "--shrink", "twoknob", "--a", "1", "--b", "0", "--quiet"
    )
    assert r1.returncode == 0 and r2.returncode == 0, r1.stderr + r2.stderr
    shards = sorted(p.name for p in (tmp_path / "hard").glob("*.safetensors"))
    assert len(shards) == 2
    for name in shards:
        assert (tmp_path / "hard" / name).read_bytes() == (tmp_path / "tk" / name).read_bytes()


def test_planted_signal_is_recovered(tmp_path):
    """The point of the method: the repaired update is closer to the planted low-rank signal."""
    from dghard_cli.testing.synthetic import signal_and_noise

    cfg = ArchConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1, vocab_size=256)
    dm = DeltaModel(rank=3, signal=5.0, noise=2e-3)
    base, ft = make_pair(tmp_path, cfg, dtype="float32", ft_shards=1, seed=5, delta=dm)
    repair(base, ft, tmp_path / "out")
    b, f, o = load_dir(base), load_dir(ft), load_dir(tmp_path / "out")
    name = "model.layers.0.mlp.up_proj.weight"
    sig, _ = signal_and_noise(name, tuple(b[name].shape), 5, dm)
    err_ft = rel(f64(f[name]) - f64(b[name]), sig.numpy())
    err_rep = rel(f64(o[name]) - f64(b[name]), sig.numpy())
    assert err_rep < 0.25 * err_ft


def test_transformers_loads_the_output_like_the_fine_tune(tmp_path):
    transformers = pytest.importorskip("transformers")
    base, ft = make_pair(tmp_path, CFG, dtype="float32", ft_shards=3, seed=6)
    out = tmp_path / "out"
    repair(base, ft, out)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    sd = model.state_dict()
    o = load_dir(out)
    for k, v in o.items():
        assert torch.equal(sd[k], v), k
    assert model.config.vocab_size == CFG.vocab_size


def test_vocabulary_resize_repairs_shared_rows_and_keeps_new_rows(tmp_path):
    base, ft = make_pair(tmp_path, CFG, dtype="float32", ft_shards=2, seed=7, ft_vocab=CFG.vocab_size + 24)
    out = tmp_path / "out"
    report = repair(base, ft, out)
    b, f, o = load_dir(base), load_dir(ft), load_dir(out)
    recs = {r["name"]: r for r in report["tensors"]}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert recs[name]["action"] == "resized"
        v = CFG.vocab_size
        ref = f64(b[name]) + ref_filter(f64(f[name][:v]) - f64(b[name]))[0]
        assert o[name].shape == f[name].shape
        assert rel(f64(o[name][:v]), ref) < 1e-5
        assert torch.equal(o[name][v:], f[name][v:])
    assert any("vocabulary resized" in n for n in report["notes"])


def test_tied_embeddings_are_processed_once_and_stay_tied(tmp_path):
    base, ft = make_pair(tmp_path, CFG, dtype="float32", ft_shards=1, seed=8)
    # store both tensors, identical, with tie_word_embeddings in the configs
    for d in (base, ft):
        t = load_dir(d)
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
        for p in d.glob("*.safetensors"):
            p.unlink()
        cfg = json.loads((d / "config.json").read_text())
        cfg["tie_word_embeddings"] = True
        write_checkpoint(d, sorted(t.items()), shards=2, config=cfg)
    out = tmp_path / "out"
    report = repair(base, ft, out)
    o = load_dir(out)
    recs = {r["name"]: r for r in report["tensors"]}
    assert torch.equal(o["lm_head.weight"], o["model.embed_tokens.weight"])
    tied = [r for r in recs.values() if r["action"] == "tied"]
    assert len(tied) == 1 and tied[0]["tied_to"] in ("lm_head.weight", "model.embed_tokens.weight")
    primary = recs[tied[0]["tied_to"]]
    assert primary["action"] == "method" and "rank_kept" in primary and "rank_kept" not in tied[0]


def test_policy_include_exclude_min_numel_and_other_tensors(tmp_path):
    base, ft = make_pair(tmp_path, CFG, dtype="float32", ft_shards=1, seed=9)
    # a 3-D tensor, an FT-only tensor, an integer buffer
    for d, extra in ((base, {}), (ft, {"extra.adapter.weight": torch.randn(8, 8)})):
        t = load_dir(d)
        t["model.experts.weight"] = torch.randn(2, 16, 64) if d == base else torch.randn(2, 16, 64) * 1.1
        t["model.position_ids"] = torch.arange(16, dtype=torch.int64)
        t.update(extra)
        for p in d.glob("*.safetensors"):
            p.unlink()
        save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    opts = RepairOptions(policy=PolicyOptions(include=[r"layers\.0\."], exclude=[r"k_proj"], min_numel=5000))
    report = repair(base, ft, out, opts)
    recs = {r["name"]: r for r in report["tensors"]}
    assert recs["model.experts.weight"]["reason"] == "3-d"
    assert recs["extra.adapter.weight"]["reason"] == "ft-only"
    assert recs["model.position_ids"]["reason"] == "non-float"
    assert recs["model.layers.1.mlp.up_proj.weight"]["reason"] == "excluded"
    assert recs["model.layers.0.self_attn.k_proj.weight"]["reason"] == "excluded"
    assert recs["model.layers.0.self_attn.q_proj.weight"]["reason"] == "small"  # 4096 < 5000
    assert recs["model.layers.0.mlp.up_proj.weight"]["action"] == "method"
    f, o = load_dir(ft), load_dir(out)
    for name, r in recs.items():
        if r["action"] == "kept-ft":
            assert torch.equal(o[name], f[name])
    assert recs["model.experts.weight"]["delta_norm"] > 0


def test_base_only_tensors_error_or_allow_missing(tmp_path):
    base, ft = make_pair(tmp_path, CFG, dtype="float32", ft_shards=1, seed=10)
    t = load_dir(ft)
    del t["model.layers.1.mlp.up_proj.weight"]
    (ft / "model.safetensors").unlink()
    save_file(t, str(ft / "model.safetensors"))
    with pytest.raises(InputError, match="up_proj.*allow-missing"):
        repair(base, ft, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    report = repair(base, ft, tmp_path / "out", RepairOptions(policy=PolicyOptions(allow_missing=True)))
    recs = {r["name"]: r for r in report["tensors"]}
    assert recs["model.layers.1.mlp.up_proj.weight"]["action"] == "kept-base"
    assert torch.equal(
        load_dir(tmp_path / "out")["model.layers.1.mlp.up_proj.weight"],
        load_dir(base)["model.layers.1.mlp.up_proj.weight"],
    )


def test_unchanged_and_rank_zero_tensors(tmp_path):
    base, ft = make_pair(tmp_path, CFG, dtype="float32", ft_shards=1, seed=11)
    t = load_dir(ft)
    t["model.layers.0.mlp.up_proj.weight"] = load_dir(base)["model.layers.0.mlp.up_proj.weight"]
    (ft / "model.safetensors").unlink()
    save_file(t, str(ft / "model.safetensors"))
    report = repair(base, ft, tmp_path / "out")
    recs = {r["name"]: r for r in report["tensors"]}
    assert recs["model.layers.0.mlp.up_proj.weight"]["reason"] == "unchanged"
    assert torch.equal(
        load_dir(tmp_path / "out")["model.layers.0.mlp.up_proj.weight"],
        t["model.layers.0.mlp.up_proj.weight"],
    )
    # a huge scale keeps nothing: every repaired matrix equals the base exactly
    report = repair(base, ft, tmp_path / "out0", RepairOptions(spec=ShrinkSpec(scale=1e6)))
    b, o = load_dir(base), load_dir(tmp_path / "out0")
    for r in report["tensors"]:
        if r["action"] == "method":
            assert r["rank_kept"] == 0 and torch.equal(o[r["name"]], b[r["name"]])


def test_merged_lora_is_detected_not_pretended(tmp_path):
    """FT = BASE + B·A in float32: the median singular value is rounding noise."""
    base, _ = make_pair(tmp_path, CFG, dtype="float32", ft_shards=1, seed=12)
    b = load_dir(base)
    g = torch.Generator().manual_seed(0)
    ft_t = {}
    for k, v in b.items():
        if v.ndim == 2:
            bb = torch.randn(v.shape[0], 4, generator=g) * 0.05
            aa = torch.randn(4, v.shape[1], generator=g) * 0.05
            ft_t[k] = (v.double() + bb.double() @ aa.double()).float()
        else:
            ft_t[k] = v.clone()
    ft = tmp_path / "lora_ft"
    write_checkpoint(
        ft, sorted(ft_t.items()), shards=1, config=json.loads((base / "config.json").read_text())
    )
    report = repair(base, ft, tmp_path / "out")
    low = [r for r in report["tensors"] if r.get("reason") == "low-rank"]
    assert len(low) == 16 and all(r["low_rank"] == 4 for r in low)
    assert report["summary"]["low_rank_tensors"] == 16
    assert any("low-rank" in w for w in report["summary"]["warnings"])
    o = load_dir(tmp_path / "out")
    for k, v in ft_t.items():
        assert torch.equal(o[k], v)
    # with a known noise level the threshold is meaningful again and the low-rank update is kept
    report = repair(base, ft, tmp_path / "known", RepairOptions(spec=ShrinkSpec(noise="known", sigma=1e-6)))
    ranks = [r["rank_kept"] for r in report["tensors"] if r["action"] == "method"]
    assert ranks and all(r == 4 for r in ranks)


def test_shard_size_and_dtype_options(tmp_path):
    base, ft = make_pair(tmp_path, CFG, dtype="float32", ft_shards=1, seed=13)
    out = tmp_path / "out"
    report = repair(base, ft, out, RepairOptions(policy=PolicyOptions(shard_size=200_000, out_dtype="BF16")))
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) == report["output"]["shards"] > 1
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    o = load_dir(out)
    assert set(index["weight_map"]) == set(o)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in o.values())
    assert all(v.dtype == torch.bfloat16 for v in o.values())
    for p in out.glob("*.safetensors"):
        assert p.stat().st_size <= 200_000 + 4096 or len(load_dir_file(p)) == 1


def load_dir_file(p: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(p))


def test_dry_run_reads_headers_only_and_writes_nothing(tmp_path):
    base, ft = make_pair(tmp_path, CFG, dtype="float32", ft_shards=3, seed=14)
    out = tmp_path / "out"
    doc = repair(base, ft, out, RepairOptions(run=RunOptions(dry_run=True)))
    assert not out.exists() and not list(tmp_path.glob(".*partial"))
    assert doc["summary"]["dry_run"] and doc["summary"]["actions"]["method"] == 16
    r = run_dghard("repair", base, ft, out, "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["summary"]["actions"] == doc["summary"]["actions"]
    assert not out.exists()


def test_cli_repair_report_elsewhere_json_and_overwrite(tmp_path):
    base, ft = make_pair(tmp_path, CFG, dtype="float32", ft_shards=2, seed=15)
    out = tmp_path / "out"
    rep = tmp_path / "elsewhere.json"
    r = run_dghard("repair", base, ft, out, "--report", rep, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)  # exactly one JSON document on stdout
    assert json.loads(rep.read_text())["summary"] == doc["summary"]
    assert not (out / "dghard_report.json").exists()
    r = run_dghard("repair", base, ft, out)
    assert r.returncode == 2 and "--overwrite" in r.stderr
    r = run_dghard("repair", base, ft, out, "--overwrite", "--report", out / "sub" / "r.json", "-q")
    assert r.returncode == 0 and r.stdout == "" and (out / "sub" / "r.json").exists()


def test_energy_and_verdict_are_reported(tmp_path):
    base, ft = make_pair(tmp_path, CFG, dtype="float32", ft_shards=1, seed=16)
    report = repair(base, ft, tmp_path / "out")
    s = report["summary"]
    recs = [r for r in report["tensors"] if r["action"] == "method"]
    num = sum(r["delta_norm"] ** 2 * r["energy_kept"] for r in recs)
    den = sum(r["delta_norm"] ** 2 for r in recs)
    assert abs(s["energy_kept"] - num / den) < 1e-9
    assert s["verdict"].startswith(("noise bulk found", "no noise bulk", "no Marchenko"))
    for r in recs:
        for key in (
            "beta",
            "median_sv",
            "tau",
            "rank_kept",
            "energy_kept",
            "ks_distance",
            "share_above_mp_edge",
            "noise_level",
            "seconds",
            "delta_norm",
            "shape",
            "dtype",
        ):
            assert key in r, key
        assert 0 <= r["energy_kept"] <= 1
    np.testing.assert_allclose(report["tensors"][0]["shape"], [CFG.vocab_size, CFG.hidden_size])


def test_cli_human_output_on_the_shipped_example(tmp_path):
    example = Path(__file__).resolve().parent.parent / "examples" / "tiny"
    r = run_dghard("repair", example / "base", example / "ft", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert "verdict" in r.stdout and "energy kept" in r.stdout
    assert "[dghard]" in r.stderr  # plain progress lines in a non-interactive log
    r = run_dghard("repair", example / "base", example / "ft", tmp_path / "plan", "--dry-run", "--verbose")
    assert r.returncode == 0 and "model.layers.0.mlp.up_proj.weight" in r.stdout
    r = run_dghard("--version")
    assert r.returncode == 0 and r.stdout.startswith("dghard ")


def test_row_blocked_streaming_equals_the_unblocked_route(tmp_path):
    """Tall matrices read from disk in small row blocks give the in-memory result to fp32 rounding."""
    from dghard_cli.engine.pipeline import EngineOptions

    cfg = ArchConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=1, vocab_size=2000)
    base, ft = make_pair(tmp_path, cfg, dtype="float32", ft_shards=2, seed=21)
    whole = repair(base, ft, tmp_path / "whole", RepairOptions(block_bytes=1 << 30))
    tiny = RepairOptions(
        block_bytes=64 * 64 * 8 * 7, run=RunOptions(engine=EngineOptions(stream_bytes=0, prefetch_bytes=1))
    )
    blocked = repair(base, ft, tmp_path / "blocked", tiny)
    a, b = load_dir(tmp_path / "whole"), load_dir(tmp_path / "blocked")
    for k in a:
        assert rel(f64(b[k]), f64(a[k])) <= 2.0**-24, k
    ranks = lambda rep: [r.get("rank_kept") for r in rep["tensors"]]  # noqa: E731
    assert ranks(whole) == ranks(blocked)
    # where the time went: everything prefetched in one run, everything read in row blocks by the
    # compute thread in the other; the parts of the compute thread's loop fit in the process time
    for rep, inline in ((whole, False), (blocked, True)):
        st, t = rep["timings"]["stages"], rep["timings"]
        assert set(st) == {"read", "read_inline", "compute", "write", "wait_read", "wait_write"}
        assert all(v >= 0 for v in st.values()) and st["write"] > 0 and st["compute"] > 0
        assert (st["read_inline"] > 0) == inline and (st["read"] > 0) != inline
        loop = st["compute"] + st["read_inline"] + st["wait_read"] + st["wait_write"]
        assert loop <= t["process"] + 0.01


def test_a_large_job_after_small_parallel_ones_does_not_deadlock(tmp_path):
    """A job read ahead whole but computed alone (inputs above ``parallel_bytes``) whose inputs
    exceed what the small jobs in flight leave of the read-ahead budget: the prefetcher waited
    for that budget, which was returned only when the main thread wrote the small jobs, and the
    main thread waited for the prefetcher (a 7B Llama's MLP after its attention matrices)."""
    import threading

    from dghard_cli.engine.pipeline import EngineOptions

    cfg = ArchConfig(hidden_size=48, intermediate_size=136, num_hidden_layers=2, vocab_size=200)
    base, ft = make_pair(tmp_path, cfg, dtype="float32", ft_shards=1, seed=5)
    # attention: 2 × 9 KB of inputs (parallel); MLP: 2 × 26 KB (alone); budget 60 KB < 36 + 52
    engine = EngineOptions(prefetch_bytes=60_000, parallel_bytes=20_000, compute_workers=2)
    opts = RepairOptions(run=RunOptions(quiet=True, engine=engine))
    done: list = []
    t = threading.Thread(target=lambda: done.append(repair(base, ft, tmp_path / "out", opts)), daemon=True)
    t.start()
    t.join(timeout=120)
    assert done, "repair did not finish in 120 s (the read-ahead deadlocked)"
    whole = repair(base, ft, tmp_path / "ref", RepairOptions(run=RunOptions(quiet=True)))
    a, b = load_dir(tmp_path / "out"), load_dir(tmp_path / "ref")
    assert all(torch.equal(a[k], b[k]) for k in b)
    assert [r.get("rank_kept") for r in done[0]["tensors"]] == [r.get("rank_kept") for r in whole["tensors"]]
