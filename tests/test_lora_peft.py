"""LoRA fine-tunes end to end, against real PEFT and float64 references.

Tiny transformers Llama (untied) and Qwen2 (tied embeddings, q/k/v biases) models are built and
saved here; adapters are made with ``get_peft_model`` (random non-zero B) and ``save_pretrained``.
Checked: an adapter as FT is BASE + ΔW exactly as PEFT merges it (``--merge`` equals
``merge_and_unload()``, for rsLoRA, rank/alpha patterns, embeddings, ``modules_to_save``, DoRA,
``lora_bias``, Conv1D/``fan_in_fan_out``); strengths of adapters are adapters whose logits under
``PeftModel.from_pretrained`` equal a float64 model with W_base + λ·ΔW; several adapters
concatenate; TIES of adapters is the exact SVD truncation of the full TIES merge; any repair
written with ``--format peft`` gives the full repair's logits; audit-lora knows PEFT 0.21's keys.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import f64, load_dir, run_dghard
from safetensors.torch import load_file

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from dghard_cli.audit.auditor import audit_lora  # noqa: E402
from dghard_cli.engine.writer import RunOptions  # noqa: E402
from dghard_cli.errors import InputError  # noqa: E402
from dghard_cli.inspection import InspectOptions, inspect_pair  # noqa: E402
from dghard_cli.lora.config_keys import KNOWN_KEYS, _fields_from_source, installed_peft_fields  # noqa: E402
from dghard_cli.lora.output import LoraOutputOptions  # noqa: E402
from dghard_cli.merging import MergeOptions, merge  # noqa: E402
from dghard_cli.repairing import RepairOptions, repair  # noqa: E402
from dghard_cli.spectral.spectrum import ShrinkSpec  # noqa: E402

warnings.filterwarnings("ignore", module="peft")
transformers.logging.set_verbosity_error()

SIZES = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
VOCAB = 128
P = "base_model.model."
CLASSES = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "gpt2": GPT2LMHeadModel}


def build_model(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**SIZES, vocab_size=VOCAB, tie_word_embeddings=False))
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**SIZES, vocab_size=VOCAB, tie_word_embeddings=True))
    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=32))


def load(kind: str, path: Path):
    return CLASSES[kind].from_pretrained(str(path)).eval()


def make_adapter(kind: str, base: Path, out: Path, *, seed: int, std: float = 0.05, **lora) -> Path:
    """A PEFT adapter on ``base`` with random non-zero B (and trained-looking extras), saved by PEFT."""
    model = get_peft_model(load(kind, base), LoraConfig(**lora))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            trained = ("lora_B" in name or "lora_embedding_B" in name or "modules_to_save" in name) or (
                "lora_magnitude" in name or (name.endswith("bias") and p.requires_grad)
            )
            if trained:
                p.add_(std * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(out))
    return out


def logits(model, tokens: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return model(tokens).logits.to(torch.float64).numpy()


def float64_model(kind: str, base: Path, deltas: dict[str, np.ndarray]):
    """BASE in float64 with ``deltas`` (tensor name -> float64 update) added."""
    model = load(kind, base).to(torch.float64)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, d in deltas.items():
            params[name].add_(torch.from_numpy(d))
    return model


def lora_deltas(adapter: Path) -> dict[str, np.ndarray]:
    """ΔW = (α/r)·B·A per module, from the saved file (plain LoRA: no patterns, no rsLoRA)."""
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert not cfg["rank_pattern"] and not cfg["alpha_pattern"] and not cfg["use_rslora"]
    sd = load_file(str(adapter / "adapter_model.safetensors"))
    out = {}
    for key in sd:
        if key.endswith(".lora_A.weight"):
            module = key[len(P) : -len(".lora_A.weight")]
            a, b = f64(sd[key]), f64(sd[f"{P}{module}.lora_B.weight"])
            out[f"{module}.weight"] = cfg["lora_alpha"] / cfg["r"] * (b @ a)
    return out


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(seed))


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def peft_logits(kind: str, base: Path, adapter: Path, x: torch.Tensor) -> np.ndarray:
    return logits(PeftModel.from_pretrained(load(kind, base), str(adapter)).eval(), x)


def quiet(**kw) -> RunOptions:
    return RunOptions(quiet=True, device="cpu", **kw)


def merge_opts(method: str, **kw) -> MergeOptions:
    lora = kw.pop("lora", LoraOutputOptions())
    return MergeOptions(method=method, lora=lora, run=quiet(), **kw)


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bases")
    out = {}
    for kind in ("llama", "qwen2"):
        build_model(kind).save_pretrained(str(root / kind))
        out[kind] = root / kind
    return out


@pytest.fixture(scope="module")
def full_fts(bases, tmp_path_factory) -> dict[str, Path]:
    """Full fine-tunes: every tensor moved (matrices by a rank-3 signal plus i.i.d. noise)."""
    root = tmp_path_factory.mktemp("fts")
    out = {}
    for kind, base in bases.items():
        model = load(kind, base)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for _, p in model.named_parameters():
                if p.ndim == 2:
                    u, v = torch.randn(p.shape[0], 3, generator=g), torch.randn(3, p.shape[1], generator=g)
                    p.add_(0.01 * u @ v + 1e-3 * torch.randn(p.shape, generator=g))
                else:
                    p.add_(0.01 * torch.randn(p.shape, generator=g))
        model.save_pretrained(str(root / kind))
        out[kind] = root / kind
    return out


# -- the --allow-missing trap ---------------------------------------------------------------------------
def test_adapter_as_ft_is_never_written_as_base_plus_raw_factors(bases, tmp_path):
    """Before: an adapter given as FT was refused with a hint to pass --allow-missing, and following
    the hint wrote BASE's weights plus the raw lora_A/lora_B tensors, exit 0. Now the adapter is
    read as BASE + ΔW: DG-Hard says why it cannot cut it (exit 2, nothing written), and a merge
    writes a real adapter."""
    ad = make_adapter(
        "llama", bases["llama"], tmp_path / "ad", seed=1, r=4, lora_alpha=8, target_modules=["q_proj"]
    )
    out = tmp_path / "out"
    res = run_dghard("repair", bases["llama"], ad, out, "--allow-missing")
    assert res.returncode == 2, res.stderr
    assert "LoRA adapter" in res.stderr and "--merge" in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob(".out*"))
    res = run_dghard(
        "merge", "--method", "task-arithmetic", bases["llama"], ad, "--out", out, "--allow-missing"
    )
    assert res.returncode == 0, res.stderr
    names = set(load_file(str(out / "adapter_model.safetensors")))
    assert names and all(".lora_" in n for n in names)
    x = tokens()
    ref = logits(float64_model("llama", bases["llama"], lora_deltas(ad)), x)
    assert rel(peft_logits("llama", bases["llama"], out, x), ref) < 1e-5


# -- adapters in: BASE + ΔW exactly as PEFT merges ----------------------------------------------------------
CASES = {
    "rslora-patterns-embedding-lm_head": (
        "llama",
        dict(
            r=4,
            lora_alpha=8,
            use_rslora=True,
            target_modules=["q_proj", "v_proj", "up_proj", "embed_tokens", "lm_head"],
            rank_pattern={"v_proj": 2, "model.layers.1.mlp.up_proj": 6},
            alpha_pattern={"q_proj": 3},
        ),
    ),
    "modules_to_save": (
        "llama",
        dict(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["model.norm", "lm_head"]),
    ),
    "dora": ("llama", dict(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], use_dora=True)),
    "lora_bias+trained-bias": (
        "qwen2",
        dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"], lora_bias=True),
    ),
    "qwen2-bias-lora_only": (
        "qwen2",
        dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], bias="lora_only"),
    ),
    "gpt2-conv1d-fan_in_fan_out": (
        "gpt2",
        dict(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_merge_equals_peft_merge_and_unload(case, bases, tmp_path):
    kind, lora = CASES[case]
    if kind in bases:
        base = bases[kind]
    else:
        base = tmp_path / "base"
        build_model(kind).save_pretrained(str(base))
    ad = make_adapter(kind, base, tmp_path / "ad", seed=3, **lora)
    out = tmp_path / "merged"
    doc = merge(
        str(base), [str(ad)], str(out), merge_opts("task-arithmetic", lora=LoraOutputOptions(merge=True))
    )
    assert doc["output"]["path"] == str(out) and doc["parameters"]["merge"] is True
    ref = PeftModel.from_pretrained(load(kind, base), str(ad)).merge_and_unload()
    want = {k: v for k, v in ref.state_dict().items()}
    got = load_dir(out)
    assert set(got) <= set(want)
    for name, t in got.items():
        assert t.dtype == want[name].dtype, name
        assert torch.allclose(t, want[name], atol=2e-7, rtol=1e-6), (name, (t - want[name]).abs().max())
    assert json.loads((out / "config.json").read_text())["model_type"] == load(kind, base).config.model_type
    assert not (out / "adapter_config.json").exists()
    x = tokens()
    assert rel(logits(load(kind, out), x), logits(ref, x)) < 1e-5


def test_tied_adapter_follows_peft_forward(bases, tmp_path):
    """ensure_weight_tying: PEFT saves the tied lm_head's LoRA too; a tied BASE stores one weight,
    which gets the update once (PEFT's forward), not twice (PEFT 0.21's merge_and_unload)."""
    base = bases["qwen2"]
    ad = make_adapter(
        "qwen2",
        base,
        tmp_path / "ad",
        seed=4,
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "embed_tokens"],
        ensure_weight_tying=True,
    )
    (ad / "tokenizer_config.json").write_text('{"chat_template": "the fine-tune\'s"}')
    (ad / "trainer_state.json").write_text("{}")
    out = tmp_path / "merged"
    merge(str(base), [str(ad)], str(out), merge_opts("task-arithmetic", lora=LoraOutputOptions(merge=True)))
    x = tokens()
    assert rel(logits(load("qwen2", out), x), peft_logits("qwen2", base, ad, x)) < 1e-5
    # BASE's config, the adapter's tokenizer files, nothing else of the adapter's
    assert (out / "config.json").read_bytes() == (base / "config.json").read_bytes()
    assert "the fine-tune" in (out / "tokenizer_config.json").read_text()
    assert not (out / "trainer_state.json").exists() and not (out / "adapter_config.json").exists()


# -- adapters out: strengths are exact in adapter form --------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_wise_ft_of_an_adapter_is_an_adapter(kind, bases, tmp_path):
    base = bases[kind]
    targets = ["q_proj", "v_proj", "down_proj"] + (["embed_tokens"] if kind == "qwen2" else [])
    ad = make_adapter(kind, base, tmp_path / "ad", seed=5, r=4, lora_alpha=16, target_modules=targets)
    out = tmp_path / "weaker"
    doc = merge(str(base), [str(ad)], str(out), merge_opts("wise-ft", alpha=0.4))
    assert doc["adapter"]["route"] == "exact"
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
        "dghard_report.json",
    ]
    sd_in, sd_out = (
        load_file(str(ad / "adapter_model.safetensors")),
        load_file(str(out / "adapter_model.safetensors")),
    )
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == cfg["lora_alpha"] == 4 and cfg["rank_pattern"] == {}
    for key, a in sd_in.items():  # A unchanged, B scaled by α·scaling (scaling 1 in the output)
        if key.endswith(("lora_A.weight", "lora_embedding_A")):
            assert torch.equal(sd_out[key], a)
        elif key.endswith(("lora_B.weight", "lora_embedding_B")):
            assert torch.allclose(sd_out[key], a * (0.4 * 16 / 4), rtol=1e-6, atol=0)
    deltas = {}
    for key in sd_in:
        if key.endswith(".lora_A.weight"):
            m = key[len(P) : -len(".lora_A.weight")]
            deltas[f"{m}.weight"] = 0.4 * 4.0 * (f64(sd_in[f"{P}{m}.lora_B.weight"]) @ f64(sd_in[key]))
        elif key.endswith(".lora_embedding_A"):
            m = key[len(P) : -len(".lora_embedding_A")]
            deltas[f"{m}.weight"] = 0.4 * 4.0 * (f64(sd_in[f"{P}{m}.lora_embedding_B"]) @ f64(sd_in[key])).T
    x = tokens()
    ref = logits(float64_model(kind, base, deltas), x)
    assert rel(peft_logits(kind, base, out, x), ref) < 1e-5


def test_several_adapters_concatenate_like_peft_cat(bases, tmp_path):
    base = bases["llama"]
    a1 = make_adapter(
        "llama", base, tmp_path / "a1", seed=6, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
    )
    a2 = make_adapter(
        "llama", base, tmp_path / "a2", seed=7, r=2, lora_alpha=4, target_modules=["q_proj", "o_proj"]
    )
    out = tmp_path / "sum"
    doc = merge(
        str(base), [str(a1), str(a2)], str(out), merge_opts("task-arithmetic", weights=[1.0, -0.5], lam=0.8)
    )
    ranks = {r["module"]: r["rank"] for r in doc["tensors"] if r.get("written_as") == "lora"}
    assert ranks["model.layers.0.self_attn.q_proj"] == 6 and ranks["model.layers.0.self_attn.v_proj"] == 4
    assert ranks["model.layers.0.self_attn.o_proj"] == 2
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == 6 and set(cfg["rank_pattern"].values()) == {2, 4}
    d1, d2 = lora_deltas(a1), lora_deltas(a2)
    deltas = {n: 0.8 * d1.get(n, 0) - 0.4 * d2.get(n, 0) for n in set(d1) | set(d2)}
    x = tokens()
    ref = logits(float64_model("llama", base, deltas), x)
    got = peft_logits("llama", base, out, x)
    assert rel(got, ref) < 1e-5
    # the same as PEFT's own add_weighted_adapter(combination_type="cat")
    model = PeftModel.from_pretrained(load("llama", base), str(a1), adapter_name="a1")
    model.load_adapter(str(a2), adapter_name="a2")
    model.add_weighted_adapter(["a1", "a2"], [0.8, -0.4], "cat", combination_type="cat")
    model.set_adapter("cat")
    assert rel(got, logits(model, x)) < 1e-5
    # --merge writes the same as a full checkpoint
    full = tmp_path / "sum-full"
    merge(
        str(base),
        [str(a1), str(a2)],
        str(full),
        merge_opts("task-arithmetic", weights=[1.0, -0.5], lam=0.8, lora=LoraOutputOptions(merge=True)),
    )
    assert rel(logits(load("llama", full), x), ref) < 1e-5


def test_ties_of_adapters_is_the_exact_svd_truncation(bases, tmp_path):
    base = bases["llama"]
    kw = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    a1 = make_adapter("llama", base, tmp_path / "a1", seed=8, **kw)
    a2 = make_adapter("llama", base, tmp_path / "a2", seed=9, **kw)
    full = tmp_path / "ties-full"
    lora_full = LoraOutputOptions(merge=True)
    merge(str(base), [str(a1), str(a2)], str(full), merge_opts("ties", density=0.3, lora=lora_full))
    out = tmp_path / "ties"
    doc = merge(
        str(base),
        [str(a1), str(a2)],
        str(out),
        merge_opts("ties", density=0.3, lora=LoraOutputOptions(rank=3)),
    )
    w_full, w_base = load_dir(full), load_dir(base)
    sd = load_file(str(out / "adapter_model.safetensors"))
    recs = {r["module"]: r for r in doc["tensors"] if r.get("written_as") == "lora"}
    assert len(recs) == 4
    for m, rec in recs.items():
        d = f64(w_full[f"{m}.weight"]) - f64(w_base[f"{m}.weight"])
        u, s, vt = np.linalg.svd(d)
        best = (u[:, :3] * s[:3]) @ vt[:3]
        got = f64(sd[f"{P}{m}.lora_B.weight"]) @ f64(sd[f"{P}{m}.lora_A.weight"])
        assert rec["rank"] == 3
        assert np.max(np.abs(got - best)) < 1e-6 * np.max(np.abs(d)), m
        lost = float(np.sum(s[3:] ** 2) / np.sum(s**2))
        assert rec["energy_lost"] == pytest.approx(lost, rel=1e-4, abs=1e-9)
    assert doc["adapter"]["energy_lost_max"] == pytest.approx(max(r["energy_lost"] for r in recs.values()))


# -- spectral methods on adapters -------------------------------------------------------------------------
def test_dg_hard_on_an_adapter_says_why_and_merge_repairs_the_merged_model(bases, tmp_path):
    base = bases["llama"]
    ad = make_adapter(
        "llama",
        base,
        tmp_path / "ad",
        seed=10,
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        modules_to_save=["lm_head"],
    )
    with pytest.raises(InputError, match="only r non-zero singular values"):
        repair(str(base), str(ad), str(tmp_path / "x"), RepairOptions(run=quiet()))
    with pytest.raises(InputError, match="undefined"):
        merge(str(base), [str(ad)], str(tmp_path / "y"), merge_opts("dg-hard"))
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    out = tmp_path / "repaired"
    doc = repair(str(base), str(ad), str(out), RepairOptions(run=quiet(), lora=LoraOutputOptions(merge=True)))
    by = {r["name"]: r for r in doc["tensors"]}
    for m in ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj"):
        assert by[f"{m}.weight"]["reason"] == "low-rank"  # keeps the adapter's update, says so
    # the modules_to_save copy of lm_head was moved by pure i.i.d. noise: the cut is defined on it
    # (a full-rank delta) and drops it all, back to BASE's value
    assert by["lm_head.weight"]["action"] == "method" and by["lm_head.weight"]["rank_kept"] == 0
    merged = PeftModel.from_pretrained(load("llama", base), str(ad)).merge_and_unload().state_dict()
    got = load_dir(out)
    assert torch.equal(got["lm_head.weight"], load_dir(base)["lm_head.weight"])
    assert torch.allclose(
        got["model.layers.0.self_attn.q_proj.weight"],
        merged["model.layers.0.self_attn.q_proj.weight"],
        atol=2e-7,
    )


def test_known_noise_on_an_adapter_writes_an_adapter(bases, tmp_path):
    base = bases["llama"]
    ad = make_adapter(
        "llama", base, tmp_path / "ad", seed=11, r=6, lora_alpha=6, target_modules=["q_proj", "down_proj"]
    )
    # a known noise level whose threshold τ = λ*(1)·√64·σ falls mid-spectrum of layer 0's q_proj
    sv = np.linalg.svd(lora_deltas(ad)["model.layers.0.self_attn.q_proj.weight"], compute_uv=False)
    spec = ShrinkSpec(noise="known", sigma=float(np.sqrt(sv[2] * sv[3])) / (np.sqrt(16 / 3) * 8))
    out, full = tmp_path / "cut", tmp_path / "cut-full"
    doc = repair(str(base), str(ad), str(out), RepairOptions(spec=spec, run=quiet()))
    repair(
        str(base),
        str(ad),
        str(full),
        RepairOptions(spec=spec, run=quiet(), lora=LoraOutputOptions(merge=True)),
    )
    kept = [r["rank"] for r in doc["tensors"] if r.get("written_as") == "lora"]
    assert kept and max(kept) <= 6 and min(kept) < 6  # the threshold dropped weak directions
    x = tokens()
    assert rel(peft_logits("llama", base, out, x), logits(load("llama", full), x)) < 1e-5


# -- any repair or merge as an adapter ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_format_peft_of_a_dg_hard_repair_gives_the_full_repairs_logits(kind, bases, full_fts, tmp_path):
    base, ft = bases[kind], full_fts[kind]
    full, out = tmp_path / "full", tmp_path / "peft"
    rdoc = repair(str(base), str(ft), str(full), RepairOptions(run=quiet()))
    doc = repair(
        str(base), str(ft), str(out), RepairOptions(run=quiet(), lora=LoraOutputOptions(format="peft"))
    )
    ranks = {
        r["name"]: r.get("rank_kept") for r in rdoc["tensors"] if "rank_kept" in r and r["action"] == "method"
    }
    lora = {r["name"]: r for r in doc["tensors"] if r.get("written_as") == "lora"}
    for name, rec in lora.items():  # per-module rank = the kept rank
        assert rec["rank"] == ranks[name], name
        assert rec["energy_lost"] < 1e-9 and rec["factor_route"] == "range-finder-certified"
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["modules_to_save"] and "model.norm" in cfg["modules_to_save"]  # 1-D tensors in full
    if kind == "qwen2":
        assert cfg["bias"] == "lora_only" and cfg.get("ensure_weight_tying") is True
    x = tokens()
    got = peft_logits(kind, base, out, x)
    want = logits(load(kind, full), x)
    assert rel(got, want) < 1e-5
    assert doc["adapter"]["bytes"] < 0.5 * doc["adapter"]["full_checkpoint_bytes"]
    # the written adapter passes the audit, config keys included
    audit = audit_lora(str(out), str(base))
    assert [f for f in audit["findings"] if f["level"] == "error"] == []


def test_format_peft_of_a_full_rank_merge_needs_rank(bases, full_fts, tmp_path):
    base, ft = bases["llama"], full_fts["llama"]
    with pytest.raises(InputError, match="pass --rank R"):
        merge(
            str(base),
            [str(ft)],
            str(tmp_path / "x"),
            merge_opts("ties", lora=LoraOutputOptions(format="peft")),
        )
    out = tmp_path / "ties"
    doc = merge(
        str(base), [str(ft)], str(out), merge_opts("ties", lora=LoraOutputOptions(format="peft", rank=2))
    )
    lost = [r["energy_lost"] for r in doc["tensors"] if r.get("written_as") == "lora"]
    assert lost and all(0 < v < 1 for v in lost)
    assert max(r["rank"] for r in doc["tensors"] if r.get("written_as") == "lora") == 2


# -- inspect, audit ---------------------------------------------------------------------------------------------
def test_inspect_reads_an_adapter_as_its_merged_update(bases, tmp_path):
    base = bases["llama"]
    ad = make_adapter(
        "llama", base, tmp_path / "ad", seed=12, r=3, lora_alpha=6, target_modules=["q_proj", "up_proj"]
    )
    doc = inspect_pair(str(base), str(ad), InspectOptions(device="cpu"))
    adapted = [r for r in doc["tensors"] if r["name"].endswith(("q_proj.weight", "up_proj.weight"))]
    assert len(adapted) == 4 and all(r["reason"] == "low-rank" for r in adapted)
    deltas = lora_deltas(ad)
    for r in adapted:
        assert r["delta_norm"] == pytest.approx(np.linalg.norm(deltas[r["name"]]), rel=1e-5)
    untouched = [r for r in doc["tensors"] if r["name"].endswith("k_proj.weight")]
    assert untouched and all(r["reason"] == "unchanged" for r in untouched)


def test_audit_lora_knows_every_key_peft_writes(bases, tmp_path):
    """A canary on the pinned PEFT: every field of its LoraConfig is in the audit's table, the
    installed release's fields read from its source are the dataclass's, and an adapter it saves
    gets no config finding, at ``--fail-on warn`` too (PEFT 0.22's ``astra_config`` was called a
    typo of ``kasa_config``)."""
    fields = {f.name for f in dataclasses.fields(LoraConfig)}
    assert fields <= KNOWN_KEYS, sorted(fields - KNOWN_KEYS)
    import peft

    root = Path(peft.__file__).parent
    assert _fields_from_source(root) == fields
    installed = installed_peft_fields()
    assert installed is not None and installed.fields == fields and installed.version == peft.__version__
    ad = make_adapter(
        "llama", bases["llama"], tmp_path / "ad", seed=13, r=4, lora_alpha=8, target_modules=["q_proj"]
    )
    raw = json.loads((ad / "adapter_config.json").read_text())
    assert set(raw) <= fields | {"peft_type", "auto_mapping", "task_type", "revision"}
    doc = audit_lora(str(ad), str(bases["llama"]))
    assert [f["code"] for f in doc["findings"] if f["code"].startswith("CONFIG_")] == []
    assert [f for f in doc["findings"] if f["level"] in ("error", "warn")] == []
    res = run_dghard("audit-lora", ad, "--base", bases["llama"], "--fail-on", "warn")
    assert res.returncode == 0, res.stdout + res.stderr


# -- refusals ---------------------------------------------------------------------------------------------------
def test_adapters_that_are_not_plain_lora_are_refused_with_a_reason(bases, tmp_path):
    base = bases["llama"]
    ad = make_adapter("llama", base, tmp_path / "ad", seed=14, r=4, lora_alpha=8, target_modules=["q_proj"])
    cfg = json.loads((ad / "adapter_config.json").read_text())
    cfg["kasa_config"] = {"enabled": True}
    (ad / "adapter_config.json").write_text(json.dumps(cfg))
    res = run_dghard("merge", "--method", "wise-ft", base, ad, "--out", tmp_path / "o")
    assert res.returncode == 2 and "kasa_config" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    with pytest.raises(InputError, match="BASE .* is a PEFT LoRA adapter"):
        merge(str(ad), [str(base)], str(tmp_path / "o2"), merge_opts("wise-ft"))
    with pytest.raises(InputError, match="--merge merges a LoRA adapter"):
        merge(
            str(base),
            [str(base)],
            str(tmp_path / "o3"),
            merge_opts("wise-ft", lora=LoraOutputOptions(merge=True)),
        )


# -- sweep ------------------------------------------------------------------------------------------------------
SWEEP_EVAL = """
import json, sys
from pathlib import Path
import numpy as np
from safetensors.numpy import load_file

root = Path(__file__).parent
model, output = Path(sys.argv[1]), sys.argv[2]
assert (model / "config.json").exists(), "the evaluation needs a model directory"
base = load_file(str(root / "base.safetensors"))
m = load_file(str(model / "model.safetensors"))
s = np.load(root / "signal.npz")
num = den = sq = 0.0
for name in s.files:
    d = m[name].astype(np.float64) - base[name].astype(np.float64)
    num += float(np.sum(d * s[name])); den += float(np.sum(s[name] ** 2)); sq += float(np.sum(d * d))
p, q = num / den, sq / den
Path(output).write_text(json.dumps({"task": 40 + 40 * p, "general": 70 - 30 * q, "chat": 50.0}))
"""


def test_sweep_takes_an_adapter_and_writes_a_wise_ft_winner_as_an_adapter(bases, tmp_path):
    from dghard_cli.sweeping.run import SweepOptions, sweep

    base = bases["llama"]
    ad = make_adapter(
        "llama", base, tmp_path / "ad", seed=15, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
    )
    deltas = lora_deltas(ad)
    np.savez(tmp_path / "signal.npz", **deltas)
    (tmp_path / "base.safetensors").write_bytes((base / "model.safetensors").read_bytes())
    (tmp_path / "eval.py").write_text(SWEEP_EVAL)
    families = [{"family": "hard", "grid": [1.0]}, {"family": "wise-ft", "grid": [0.3, 0.7], "refine": False}]
    out = tmp_path / "out"
    opts = SweepOptions(
        eval_template=f"python {tmp_path / 'eval.py'} {{model}} {{output}}",
        budget=4,
        families=families,
        device="cpu",
        plot=False,
    )
    doc = sweep(str(base), str(ad), str(out), opts)
    skipped = doc["skipped_families"]
    assert [s["family"] for s in skipped] == ["hard"] and "unknown-noise cut is undefined" in skipped[0][
        "skipped"
    ]
    names = [r["name"] for r in doc["candidates"]]
    assert names == ["wise-ft alpha=0.3", "wise-ft alpha=0.7"], names
    win = doc["winner"]
    assert "--merge" not in win["reproduce"]["argv"]
    # OUT holds the winner as an exact adapter (as its command writes it), ΔW = α·ΔW_ft
    # (tests/test_sweep_adapter.py: the format of each family, distances, the reproduction)
    alpha = win["params"]["alpha"]
    got = lora_deltas(out)
    assert set(got) == set(deltas)
    for name, d in deltas.items():
        assert np.allclose(got[name], alpha * d, atol=1e-6)
    assert (out / "adapter_config.json").exists() and not (out / "config.json").exists()


def test_an_interrupted_adapter_write_resumes(bases, full_fts, tmp_path, monkeypatch):
    import dghard_cli.lora.route_factored as route_factored
    from dghard_cli.errors import Interrupted

    base, ft = bases["llama"], full_fts["llama"]
    opts = RepairOptions(run=quiet(), lora=LoraOutputOptions(format="peft"))
    whole = tmp_path / "whole"
    repair(str(base), str(ft), str(whole), opts)
    real, calls = route_factored.factors, []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(route_factored, "factors", flaky)
    out = tmp_path / "out"
    with pytest.raises(Interrupted, match="run the same command again"):
        repair(str(base), str(ft), str(out), opts)
    assert not out.exists() and any(tmp_path.glob(".out.dghard-partial/dghard-spool-*"))
    monkeypatch.setattr(route_factored, "factors", real)
    doc = repair(str(base), str(ft), str(out), opts)
    assert doc["output"]["resumed_units"] >= 5
    name = "adapter_model.safetensors"
    assert (out / name).read_bytes() == (whole / name).read_bytes()
    assert not list(out.glob("dghard-spool-*")) and not list(out.glob("dghard_journal*"))


# -- the layer-wise schedule in adapter form ------------------------------------------------------------
def lines_lambda(name: str, a: float, b: float, num_layers: int = 2) -> float:
    """λ(ℓ) = a + b·ℓ/(L−1) of ``--lines a,b``, written here from the formula: embeddings a, the
    final norm and the head a + b."""
    import re

    m = re.search(r"\.layers\.(\d+)\.", name)
    if m:
        return a + b * int(m.group(1)) / (num_layers - 1)
    return a if "embed_tokens" in name else a + b


def scheduled_reference(kind: str, base: Path, adapter: Path, a: float, b: float, c: float = 1.0):
    """A float64 model with W_base + c·λ(ℓ)·ΔW, ΔW from PEFT's own merge_and_unload()."""
    merged = PeftModel.from_pretrained(load(kind, base), str(adapter)).merge_and_unload().state_dict()
    base_sd = load(kind, base).state_dict()
    deltas = {}
    for name, w in merged.items():
        if name in base_sd and w.is_floating_point():
            d = f64(w) - f64(base_sd[name])
            if np.any(d):
                deltas[name] = c * lines_lambda(name, a, b) * d
    return float64_model(kind, base, deltas), deltas


ADAPTER_SCHEDULES = {
    "llama-norm-saved": (
        "llama",
        dict(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj", "down_proj"],
            modules_to_save=["model.norm"],
        ),
    ),
    "qwen2-tied-embedding": ("qwen2", dict(r=4, lora_alpha=16, target_modules=["q_proj", "embed_tokens"])),
}


@pytest.mark.parametrize("case", list(ADAPTER_SCHEDULES))
def test_lines_on_an_adapter_is_an_adapter_with_each_module_scaled(case, bases, tmp_path):
    """Before: `repair BASE ADAPTER OUT --lines A,B` was refused ("a layer-strength schedule is
    written as a full checkpoint"). Now each module's B is scaled by its block's λ (the exact route,
    no base weight read for the factors), full tensors get W_base + λ·Δ, and PEFT's logits equal a
    float64 model with W_base + λ(ℓ)·ΔW."""
    from dghard_cli.schedule.spec import parse_lines

    kind, lora = ADAPTER_SCHEDULES[case]
    base = bases[kind]
    ad = make_adapter(kind, base, tmp_path / "ad", seed=11, **lora)
    out = tmp_path / "lines"
    doc = repair(
        str(base), str(ad), str(out), RepairOptions(spec=None, schedule=parse_lines("0.3,0.6"), run=quiet())
    )
    assert doc["adapter"]["route"] == "exact" and doc["layer_strengths"]["layers"] == [
        0.3,
        0.8999999999999999,
    ]
    assert (out / "adapter_config.json").exists() and not (out / "config.json").exists()
    sd_in = load_file(str(ad / "adapter_model.safetensors"))
    sd_out = load_file(str(out / "adapter_model.safetensors"))
    scaling = lora["lora_alpha"] / lora["r"]
    checked = 0
    for key, t in sd_in.items():
        if key.endswith((".lora_B.weight", ".lora_embedding_B")):
            lam = lines_lambda(key, 0.3, 0.6)
            assert torch.allclose(sd_out[key], t * (lam * scaling), rtol=1e-6, atol=0), key
            checked += 1
    assert checked >= 2
    rec = {r["name"]: r for r in doc["tensors"]}
    assert rec["model.layers.1.self_attn.q_proj.weight"]["layer_strength"] == pytest.approx(0.9)
    assert rec["model.layers.0.self_attn.q_proj.weight"]["layer"] == 0
    x = tokens()
    ref, _ = scheduled_reference(kind, base, ad, 0.3, 0.6)
    assert rel(peft_logits(kind, base, out, x), logits(ref, x)) < 1e-5
    # --merge writes the same model as a full checkpoint
    full = tmp_path / "lines-full"
    repair(
        str(base),
        str(ad),
        str(full),
        RepairOptions(
            spec=None, schedule=parse_lines("0.3,0.6"), run=quiet(), lora=LoraOutputOptions(merge=True)
        ),
    )
    assert rel(logits(load(kind, full), x), logits(ref, x)) < 1e-5


def test_wise_ft_under_lines_of_an_adapter_scales_by_alpha_times_lambda(bases, tmp_path):
    from dghard_cli.schedule.spec import parse_lines

    base = bases["llama"]
    ad = make_adapter(
        "llama", base, tmp_path / "ad", seed=12, r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"]
    )
    out = tmp_path / "wise"
    doc = merge(
        str(base), [str(ad)], str(out), merge_opts("wise-ft", alpha=0.5, schedule=parse_lines("0.2,1.0"))
    )
    assert doc["adapter"]["route"] == "exact" and doc["layer_strengths"]["head"] == pytest.approx(1.2)
    coeffs = {r["name"]: r["coefficients"] for r in doc["tensors"] if r.get("written_as") == "lora"}
    assert coeffs["model.layers.0.mlp.up_proj.weight"] == [pytest.approx(0.1)]
    assert coeffs["model.layers.1.mlp.up_proj.weight"] == [pytest.approx(0.6)]
    x = tokens()
    ref, _ = scheduled_reference("llama", base, ad, 0.2, 1.0, c=0.5)
    assert rel(peft_logits("llama", base, out, x), logits(ref, x)) < 1e-5


def test_format_peft_of_dg_hard_under_lines_gives_the_full_runs_logits(bases, full_fts, tmp_path):
    """DG-Hard's Δ* scaled by λ(ℓ) is still low-rank: the adapter keeps each module's kept rank
    and gives the full checkpoint's logits; a schedule alone on a full fine-tune is not low-rank and
    needs --rank, like WiSE-FT."""
    from dghard_cli.schedule.spec import parse_lines

    base, ft = bases["llama"], full_fts["llama"]
    sched = parse_lines("0.5,0.5")
    full, out = tmp_path / "full", tmp_path / "peft"
    rdoc = repair(str(base), str(ft), str(full), RepairOptions(schedule=sched, run=quiet()))
    doc = repair(
        str(base),
        str(ft),
        str(out),
        RepairOptions(schedule=sched, run=quiet(), lora=LoraOutputOptions(format="peft")),
    )
    kept = {r["name"]: r["rank_kept"] for r in rdoc["tensors"] if "rank_kept" in r}
    lora = [r for r in doc["tensors"] if r.get("written_as") == "lora"]
    assert lora and all(r["rank"] == kept[r["name"]] and r["energy_lost"] < 1e-9 for r in lora)
    assert doc["layer_strengths"] == rdoc["layer_strengths"]
    x = tokens()
    assert rel(peft_logits("llama", base, out, x), logits(load("llama", full), x)) < 1e-5
    with pytest.raises(InputError, match="pass --rank R"):
        repair(
            str(base),
            str(ft),
            str(tmp_path / "alone"),
            RepairOptions(spec=None, schedule=sched, run=quiet(), lora=LoraOutputOptions(format="peft")),
        )
    assert not (tmp_path / "alone").exists()


def test_cli_lines_on_an_adapter_exits_0_with_an_adapter(bases, tmp_path):
    ad = make_adapter(
        "llama", bases["llama"], tmp_path / "ad", seed=13, r=2, lora_alpha=4, target_modules=["v_proj"]
    )
    out = tmp_path / "out"
    res = run_dghard("repair", bases["llama"], ad, out, "--lines", "0.4,0.4")
    assert res.returncode == 0, res.stderr
    assert (out / "adapter_model.safetensors").exists()
    report = json.loads((out / "dghard_report.json").read_text())
    assert report["parameters"]["adapter_route"] == "exact" and report["layer_strengths"]["embed"] == 0.4
    assert "λ per layer" in res.stdout + res.stderr and "λ(ℓ)" in (out / "README.md").read_text()
