"""The model classes users fine-tune, end to end: tiny random transformers models saved with
``save_pretrained`` (so tensor names, shards, tied embeddings and config are what transformers
writes), fine-tuned by a random low-rank + noise delta, and put through repair (DG-Hard), a
task-arithmetic merge of two fine-tunes, ``--lines A,B`` and a PEFT LoRA adapter as FT.

Every output is checked against a float64 numpy reference written here from the definitions
(a full SVD with the Gavish–Donoho cut, ``base + λ·Σ w_i·Δ_i``, ``A + B·ℓ/(L−1)`` with the
depth of each tensor read from a per-architecture table below, ``scaling·B·A`` transposed for
Conv1D) and loaded back with ``AutoModelForCausalLM`` for a forward pass, with no missing or
unexpected key. An adapter output (``--format peft``, and the adapter a merge of an adapter
writes) must give, loaded with ``PeftModel``, the logits of the full checkpoint, or be refused in
one line when PEFT cannot hold it.

What transformers 5.25 writes, as checked here: Qwen3-MoE and Mixtral hold their experts fused
(3-D) in memory but ``save_pretrained`` writes one 2-D matrix per expert; GPT-OSS writes its
experts as 3-D tensors (``mlp.experts.gate_up_proj`` [E, H, 2I]), which repair keeps at FT's
value (reason ``3-d``) and a schedule or a merge treats elementwise. Tied configs (Qwen2 here,
Gemma, Falcon, GPT-2) store only the input embedding.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from conftest import f64, load_dir, run_dghard
from peft import LoraConfig, PeftModel, get_peft_model
from reference import ref_filter, rel
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from dghard_cli import MergeOptions, RepairOptions, RunOptions, merge, repair
from dghard_cli.errors import InputError
from dghard_cli.lora.output import LoraOutputOptions
from dghard_cli.schedule.spec import LayerSchedule

warnings.filterwarnings("ignore", module="peft")
transformers.logging.set_verbosity_error()

RUN = RunOptions(device="cpu", quiet=True)
L = 3  # blocks of every model here
VOCAB = 128
MIN_NUMEL = 1024  # repair's default --min-numel
A, B = 0.25, 0.5  # --lines A,B
LORA_R, LORA_ALPHA = 4, 8
P = "base_model.model."

DECODER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=L,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=64,
)
ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTN_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj"]
NEOX_LINEAR = ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]


@dataclass(frozen=True)
class Arch:
    """A model class and where its tensors sit, written from transformers' module tree."""

    model_type: str
    config: dict
    lora_targets: list[str]
    blocks: str = "model.layers."  # block ℓ: names starting with blocks + "ℓ."
    embed: tuple[str, ...] = ("model.embed_tokens.",)  # depth 0
    head: tuple[str, ...] = ("model.norm.", "lm_head.")  # depth 1
    tied: bool = False  # the config ties lm_head to the input embedding
    fan_in_fan_out: bool = False  # Conv1D layers (weights stored in x out)
    experts: str | None = None  # "2-d": one matrix per expert on disk; "3-d": fused [E, ...] tensors
    shards: tuple[str | None, str | None, str | None] = (None, None, None)  # max_shard_size base, ft1, ft2
    #: why ``--format peft`` of a full fine-tune is refused (a regex of the one-line error), or None
    peft_refusal: str | None = None
    #: ... and whether a fine-tune that froze the vocabulary matrices (embeddings, head) is written
    peft_if_vocabulary_frozen: bool = False


# PEFT ties an embedding's LoRA to the output layer only when the embedding is named embed_tokens
TIED_NOT_EMBED_TOKENS = (
    "PEFT ties an embedding's LoRA to the output layer only for modules named embed_tokens"
)
GPT_STYLE = dict(
    blocks="transformer.h.",
    head=("transformer.ln_f.", "lm_head."),
    tied=True,
    peft_refusal=TIED_NOT_EMBED_TOKENS,
    peft_if_vocabulary_frozen=True,
)
# transformers 5 loads Mixtral's block_sparse_moe as mlp and fuses per-expert matrices into 3-D parameters
RENAMED_MOE = (
    r"is not a module of the model transformers 5 loads \(it has (3-D parameters of all experts|'mlp')"
)
ARCHS = {
    "llama": Arch("llama", DECODER, ALL_PROJ, shards=("60KB", "100KB", None)),
    "mistral": Arch("mistral", DECODER, ALL_PROJ),
    "qwen2": Arch(
        "qwen2", {**DECODER, "tie_word_embeddings": True}, ALL_PROJ, tied=True, shards=("80KB", None, "50KB")
    ),
    "qwen3": Arch("qwen3", {**DECODER, "head_dim": 16}, ALL_PROJ),
    "qwen3_moe": Arch(
        "qwen3_moe",
        {**DECODER, "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2},
        ATTN_PROJ,
        experts="2-d",
        shards=("100KB", "60KB", None),
        peft_refusal=RENAMED_MOE,
    ),
    "mixtral": Arch(
        "mixtral",
        {**DECODER, "num_local_experts": 4, "num_experts_per_tok": 2},
        ATTN_PROJ,
        experts="2-d",
        peft_refusal=RENAMED_MOE,
    ),
    "gemma2": Arch("gemma2", {**DECODER, "head_dim": 16}, ALL_PROJ, tied=True),
    "gemma3_text": Arch(
        "gemma3_text", {**DECODER, "head_dim": 16}, ALL_PROJ, tied=True, shards=(None, "70KB", None)
    ),
    "phi3": Arch("phi3", {**DECODER, "pad_token_id": 0}, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    "olmo2": Arch("olmo2", DECODER, ALL_PROJ),
    "gpt_neox": Arch(
        "gpt_neox",
        {k: v for k, v in DECODER.items() if k != "num_key_value_heads"},
        NEOX_LINEAR,
        blocks="gpt_neox.layers.",
        embed=("gpt_neox.embed_in.",),
        head=("gpt_neox.final_layer_norm.", "embed_out."),
        shards=("90KB", "90KB", "90KB"),
        # transformers 5 loads the output layer embed_out as lm_head
        peft_refusal=r"module 'embed_out' is not a module of the model transformers 5 loads \(it has 'lm_head'",
        peft_if_vocabulary_frozen=True,
    ),
    "falcon": Arch(
        "falcon",
        dict(hidden_size=64, num_hidden_layers=L, num_attention_heads=4, vocab_size=VOCAB),
        NEOX_LINEAR,
        embed=("transformer.word_embeddings.",),
        **GPT_STYLE,
    ),
    "gpt2": Arch(
        "gpt2",
        dict(n_embd=64, n_layer=L, n_head=4, vocab_size=VOCAB, n_positions=64),
        ["c_attn", "c_proj", "c_fc"],
        embed=("transformer.wte.", "transformer.wpe."),
        fan_in_fan_out=True,
        shards=("50KB", None, "80KB"),
        **GPT_STYLE,
    ),
    "gpt_oss": Arch(
        "gpt_oss",
        {
            **DECODER,
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "sliding_window": 16,
        },
        ATTN_PROJ,
        experts="3-d",
        # the attention sinks are a parameter of the attention module itself, beside q_proj ...
        peft_refusal=r"module 'model\.layers\.0\.self_attn' would be written whole \(modules_to_save\)",
    ),
}


# -- the reference: where each tensor sits and what λ it gets --------------------------------------


def ref_place(arch: Arch, name: str) -> str | int:
    """``"embed"``, the block index or ``"head"``, from the architecture's table (exactly one match)."""
    found = []
    if name.startswith(arch.blocks):
        found.append(int(name[len(arch.blocks) :].split(".")[0]))
    if name.startswith(arch.embed):
        found.append("embed")
    if name.startswith(arch.head):
        found.append("head")
    assert len(found) == 1, (arch.model_type, name, found)
    return found[0]


def ref_lines(place: str | int) -> float:
    """λ of ``--lines A,B``: embeddings A, block ℓ A + B·ℓ/(L−1), head A + B."""
    if place == "embed":
        return A
    if place == "head":
        return A + B
    return A + B * place / (L - 1)


def eligible(name: str, b: dict, f: dict) -> bool:
    """Repair's rule, from its definition: 2-D float in BASE with equal shape, ≥ min-numel, both sides ≥ 2."""
    t = f[name]
    return (
        name in b
        and b[name].shape == t.shape
        and t.ndim == 2
        and t.is_floating_point()
        and t.numel() >= MIN_NUMEL
        and min(t.shape) >= 2
    )


def assert_close(out: torch.Tensor, ref: np.ndarray, name: str, rtol: float = 1e-6) -> None:
    """Within float32 rounding of the float64 reference (relative to the tensor's largest entry)."""
    assert tuple(out.shape) == ref.shape, name
    o = f64(out)
    err = float(np.max(np.abs(o - ref))) if ref.size else 0.0
    assert err <= rtol * max(float(np.max(np.abs(ref))), 1e-30), (name, err)


# -- the models ---------------------------------------------------------------------------------------


def perturb(model: torch.nn.Module, seed: int) -> None:
    """A fine-tune: every matrix (each expert's slice of a fused one) + rank-3 signal + i.i.d. noise,
    every vector + noise. Tied parameters are one parameter, so they move once."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim >= 2:
                u = torch.randn(*p.shape[:-1], 3, generator=g)
                v = torch.randn(*p.shape[:-2], 3, p.shape[-1], generator=g)
                p.add_(0.01 * u @ v + 1e-3 * torch.randn(p.shape, generator=g))
            else:
                p.add_(0.01 * torch.randn(p.shape, generator=g))


def save(model, path: Path, shard: str | None) -> Path:
    model.save_pretrained(str(path), **({"max_shard_size": shard} if shard else {}))
    return path


def load_model(path: Path):
    model, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info.get(key), (path, key, info[key])
    return model.eval()


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))


def logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(tokens()).logits.to(torch.float64).numpy()


def check_loads(arch: Arch, out: Path, written: dict[str, torch.Tensor]) -> np.ndarray:
    """OUT loads with transformers (every key used), runs a forward pass; tied weights stay one."""
    model = load_model(out)
    y = logits(model)
    assert y.shape == (2, 9, VOCAB) and np.all(np.isfinite(y))
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    (emb_name,) = [n for n in written if n.startswith(arch.embed[0])]  # the token embedding
    assert torch.equal(emb, written[emb_name])
    if arch.tied:
        assert head.data_ptr() == emb.data_ptr()
        assert not any(n.startswith("lm_head.") for n in written)
    else:
        assert not torch.equal(head, emb)
    return y


@dataclass
class Models:
    arch: Arch
    root: Path
    base: Path
    fts: list[Path]
    lora: Path
    b: dict[str, torch.Tensor]
    f: list[dict[str, torch.Tensor]]


@pytest.fixture(scope="module", params=list(ARCHS), ids=list(ARCHS))
def models(request, tmp_path_factory) -> Models:
    arch = ARCHS[request.param]
    root = tmp_path_factory.mktemp(arch.model_type)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch.model_type, **arch.config))
    base = save(model, root / "base", arch.shards[0])
    start = {k: v.clone() for k, v in model.state_dict().items()}
    fts = []
    for k, seed in enumerate((1, 2), start=1):
        model.load_state_dict(start)
        perturb(model, seed)
        fts.append(save(model, root / f"ft{k}", arch.shards[k]))
    # a LoRA adapter made by PEFT on BASE as transformers loads it, random non-zero B
    cfg = LoraConfig(
        r=LORA_R, lora_alpha=LORA_ALPHA, target_modules=arch.lora_targets, fan_in_fan_out=arch.fan_in_fan_out
    )
    peft_model = get_peft_model(load_model(base), cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    peft_model.save_pretrained(str(root / "lora"))
    return Models(arch, root, base, fts, root / "lora", load_dir(base), [load_dir(p) for p in fts])


# -- what transformers wrote ----------------------------------------------------------------------------


def test_saved_checkpoints_are_what_the_matrix_claims(models):
    arch, b = models.arch, models.b
    for path, shard in zip([models.base, *models.fts], arch.shards, strict=True):
        assert (path / "model.safetensors.index.json").exists() == (shard is not None), path
    assert all(ref_place(arch, n) is not None for n in b)  # every name is in the table exactly once
    assert {ref_place(arch, n) for n in b} == {"embed", "head", *range(L)}
    assert any(n.startswith("lm_head.") or n.startswith("embed_out.") for n in b) != arch.tied
    three_d = [n for n, t in b.items() if t.ndim == 3]
    assert bool(three_d) == (arch.experts == "3-d"), three_d
    if arch.experts == "2-d":
        assert any(".experts.3." in n and b[n].ndim == 2 for n in b)
    cfg = json.loads((models.fts[0] / "config.json").read_text())
    assert cfg["model_type"] == arch.model_type


# -- repair: DG-Hard ------------------------------------------------------------------------------------


def test_repair_matches_the_float64_svd_reference_and_loads(models, tmp_path):
    arch, b, f = models.arch, models.b, models.f[0]
    out = tmp_path / "repaired"
    doc = repair(models.base, models.fts[0], out, RepairOptions(run=RUN))
    o = load_dir(out)
    assert set(o) == set(f)
    recs = {r["name"]: r for r in doc["tensors"]}
    n_method = 0
    for name, t in o.items():
        rec = recs[name]
        if eligible(name, b, f):
            n_method += 1
            ref_delta, rank, tau = ref_filter(f64(f[name]) - f64(b[name]))
            assert rec["action"] == "method" and rec["rank_kept"] == rank, (name, rec)
            assert 0 < rank < min(t.shape), (name, rank)  # the cut kept the signal and removed noise
            assert abs(rec["tau"] - tau) <= 1e-9 * tau, name
            ref = f64(b[name]) + ref_delta
            assert rel(f64(t), ref) <= 1e-5, (name, rel(f64(t), ref))
        else:
            assert rec["action"] == "kept-ft", (name, rec)
            assert torch.equal(t, f[name]), name
            if t.ndim == 3:
                assert rec["reason"] == "3-d", rec
    assert n_method >= 4 * L
    if arch.experts == "2-d":  # every expert matrix is repaired on its own
        assert sum(".experts." in n and recs[n]["action"] == "method" for n in o) == 4 * 3 * L
    if (models.fts[0] / "model.safetensors.index.json").exists():  # the output mirrors FT's shards
        ft_map = json.loads((models.fts[0] / "model.safetensors.index.json").read_text())["weight_map"]
        assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"] == ft_map
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (models.fts[0] / "config.json").read_text()
    )
    check_loads(arch, out, o)


# -- merge: task arithmetic of two fine-tunes --------------------------------------------------------------


def test_task_arithmetic_of_two_fine_tunes_matches_the_reference(models, tmp_path):
    b, (f1, f2) = models.b, models.f
    out = tmp_path / "merged"
    w, lam = [1.0, 0.5], 0.7
    merge(models.base, models.fts, out, MergeOptions(method="task-arithmetic", weights=w, lam=lam, run=RUN))
    o = load_dir(out)
    assert set(o) == set(f1)
    for name, t in o.items():
        bb = f64(b[name])
        ref = bb + lam * (w[0] * (f64(f1[name]) - bb) + w[1] * (f64(f2[name]) - bb))
        assert_close(t, ref, name)
        assert t.dtype == f1[name].dtype
    check_loads(models.arch, out, o)


# -- --lines A,B: the depth of every tensor -----------------------------------------------------------------


def test_lines_gives_every_tensor_the_strength_of_its_depth(models, tmp_path):
    arch, b, f = models.arch, models.b, models.f[0]
    out = tmp_path / "lines"
    res = run_dghard("repair", models.base, models.fts[0], out, "--lines", f"{A},{B}", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    o = load_dir(out)
    assert set(o) == set(f)
    recs = {r["name"]: r for r in doc["tensors"]}
    places = set()
    for name, t in o.items():
        place = ref_place(arch, name)
        places.add(place)
        lam = ref_lines(place)
        ref = f64(b[name]) + lam * (f64(f[name]) - f64(b[name]))
        assert_close(t, ref, name)
        assert recs[name]["layer"] == place, (name, recs[name])
        assert recs[name]["layer_strength"] == pytest.approx(lam, abs=1e-15), name
        assert recs[name]["action"] == "method", recs[name]  # no shrinker: every tensor is the schedule's
    assert places == {"embed", "head", *range(L)}
    assert doc["layer_strengths"]["num_layers"] == L
    check_loads(arch, out, o)


def test_lines_with_dg_hard_scales_the_cut_update_and_everything_else(models, tmp_path):
    """``--lines A,B --shrink hard``: eligible matrices W_base + λ(ℓ)·Δ*, every other floating tensor
    (norms, biases, small and 3-D ones) W_base + λ(ℓ)·Δ (``scaled``)."""
    arch, b, f = models.arch, models.b, models.f[0]
    out = tmp_path / "lines-dg-hard"
    doc = repair(models.base, models.fts[0], out, RepairOptions(schedule=LayerSchedule(A, B), run=RUN))
    o = load_dir(out)
    assert set(o) == set(f)
    recs = {r["name"]: r for r in doc["tensors"]}
    for name, t in o.items():
        lam, rec = ref_lines(ref_place(arch, name)), recs[name]
        delta = f64(f[name]) - f64(b[name])
        if eligible(name, b, f):
            assert rec["action"] == "method", rec
            ref_delta, rank, _ = ref_filter(delta)
            assert rec["rank_kept"] == rank, name
            ref = f64(b[name]) + lam * ref_delta
            assert rel(f64(t), ref) <= 1e-5, (name, rel(f64(t), ref))
        else:
            assert rec["action"] == "scaled", rec
            assert rec["reason"] == {1: "1-d", 2: "small", 3: "3-d"}[t.ndim], rec
            assert_close(t, f64(b[name]) + lam * delta, name)


# -- a PEFT LoRA adapter as FT ------------------------------------------------------------------------------


def lora_deltas(arch: Arch, adapter: Path) -> dict[str, np.ndarray]:
    """ΔW = (α/r)·B·A per module from the saved file, transposed for Conv1D (``fan_in_fan_out``)."""
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["r"] == LORA_R and not cfg["rank_pattern"] and not cfg["use_rslora"]
    assert bool(cfg["fan_in_fan_out"]) == arch.fan_in_fan_out
    sd = load_file(str(adapter / "adapter_model.safetensors"))
    out = {}
    for key in sd:
        if key.endswith(".lora_A.weight"):
            module = key[len(P) : -len(".lora_A.weight")]
            d = LORA_ALPHA / LORA_R * (f64(sd[f"{P}{module}.lora_B.weight"]) @ f64(sd[key]))
            out[f"{module}.weight"] = d.T if arch.fan_in_fan_out else d
    return out


def test_lora_adapter_as_fine_tune_under_lines(models, tmp_path):
    """merge BASE ADAPTER --lines A,B: W_base + λ_TA·λ(ℓ)·ΔW for the adapted modules, BASE elsewhere,
    as a full checkpoint (--merge) and as an adapter (PEFT's logits equal the full checkpoint's)."""
    arch, b = models.arch, models.b
    deltas = lora_deltas(arch, models.lora)
    assert deltas and set(deltas) <= set(b)
    lam = 0.8
    sched = LayerSchedule(A, B)
    full = tmp_path / "full"
    merge(
        models.base,
        [models.lora],
        full,
        MergeOptions(
            method="task-arithmetic", lam=lam, schedule=sched, lora=LoraOutputOptions(merge=True), run=RUN
        ),
    )
    o = load_dir(full)
    assert set(o) == set(b)
    for name, t in o.items():
        if name in deltas:
            ref = f64(b[name]) + lam * ref_lines(ref_place(arch, name)) * deltas[name]
            assert_close(t, ref, name)
        else:
            assert torch.equal(t, b[name]), name
    y_full = check_loads(arch, full, o)
    adapter = tmp_path / "adapter"
    merge(
        models.base,
        [models.lora],
        adapter,
        MergeOptions(method="task-arithmetic", lam=lam, schedule=sched, run=RUN),
    )
    assert (adapter / "adapter_config.json").exists() and not (adapter / "config.json").exists()
    y_peft = logits(PeftModel.from_pretrained(load_model(models.base), str(adapter)).eval())
    assert rel(y_peft, y_full) < 1e-5


# -- --format peft: a full repair written as an adapter -----------------------------------------------------


def frozen_vocabulary_fine_tune(models: Models, path: Path) -> Path:
    """FT #1 with its token embedding and output layer left at BASE's (a fine-tune that froze them),
    saved by transformers."""
    model, base = load_model(models.fts[0]), load_model(models.base)
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(base.get_input_embeddings().weight)
        model.get_output_embeddings().weight.copy_(base.get_output_embeddings().weight)
    return save(model, path, None)


def test_format_peft_of_a_repair_gives_the_full_repairs_logits_or_is_refused(models, tmp_path):
    """The adapter written by ``repair --format peft`` loads with PEFT on BASE and gives the logits of
    the full repair; where PEFT cannot hold the update, the run is refused in one line and writes
    nothing. Before, each of these wrote an adapter whose PEFT logits were not the repair's:
    Falcon and GPT-2 left their tied embedding's LoRA for PEFT to tie, which PEFT does only for
    ``embed_tokens`` (the head kept BASE's weight); GPT-2's position embedding was written as a
    Linear LoRA, which PEFT drops on its nn.Embedding; GPT-NeoX's ``embed_out`` and Mixtral's
    ``block_sparse_moe.gate`` are named otherwise in the model transformers 5 loads, so PEFT
    skipped them; Qwen3-MoE's per-expert LoRA loads only when every expert has one of equal
    rank; GPT-OSS's attention sinks put the whole attention module in modules_to_save, an
    adapter PEFT fails to load."""
    arch = models.arch
    ft = models.fts[0]
    peft_out = LoraOutputOptions(format="peft")
    if arch.peft_refusal is not None:
        out = tmp_path / "refused"
        with pytest.raises(InputError, match=arch.peft_refusal) as exc:
            repair(models.base, ft, out, RepairOptions(run=RUN, lora=peft_out))
        assert "\n" not in str(exc.value) and not out.exists()
        if not arch.peft_if_vocabulary_frozen:
            return
        ft = frozen_vocabulary_fine_tune(models, tmp_path / "ft-frozen-vocabulary")
    full, adapter = tmp_path / "full", tmp_path / "adapter"
    repair(models.base, ft, full, RepairOptions(run=RUN))
    doc = repair(models.base, ft, adapter, RepairOptions(run=RUN, lora=peft_out))
    assert doc["adapter"]["exact"] and (adapter / "adapter_config.json").exists()
    y_full = logits(load_model(full))
    y_peft = logits(PeftModel.from_pretrained(load_model(models.base), str(adapter)).eval())
    assert rel(y_peft, y_full) < 1e-5


# -- what dghard refuses ----------------------------------------------------------------------------------


def test_all_linear_lora_on_fused_moe_experts_is_refused_by_name(tmp_path):
    """PEFT's ``all-linear`` on a transformers 5 MoE model targets the fused 3-D expert parameters
    (``target_parameters``); dghard does not read such adapters and says so in one line."""
    arch = ARCHS["qwen3_moe"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch.model_type, **arch.config))
    base = save(model, tmp_path / "base", None)
    ad = tmp_path / "ad"
    get_peft_model(load_model(base), LoraConfig(r=2, target_modules="all-linear")).save_pretrained(str(ad))
    assert json.loads((ad / "adapter_config.json").read_text())["target_parameters"]
    out = tmp_path / "out"
    res = run_dghard("merge", "--method", "task-arithmetic", base, ad, "--out", out, "--merge")
    assert res.returncode == 2, res.stderr
    assert "target_parameters" in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert not out.exists()
