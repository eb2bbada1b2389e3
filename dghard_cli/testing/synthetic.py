"""Synthetic checkpoint pairs with real architecture tensor names, for tests, benchmarks, demos.

A fine-tune is modelled as ``W_ft = W_base + signal + noise`` on every matrix: a low-rank
task signal (``rank`` directions whose strengths sit above the noise bulk) plus i.i.d. noise
(the residue the paper attributes to SGD). Norm weights and biases move a little. Files are
written shard by shard with the reference ``safetensors`` library, so a generator for a large
model holds one shard in memory, not the model.

Architectures are data: a function from the config's sizes to ``(name, shape)`` pairs.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file


@dataclass
class ArchConfig:
    model_type: str = "llama"
    hidden_size: int = 64
    intermediate_size: int = 172
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 256
    tie_word_embeddings: bool = False
    max_positions: int = 64  # GPT-2 / BERT position embeddings (rows)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_hf(self, torch_dtype: str) -> dict:
        if self.model_type == "gpt2":
            return {
                "architectures": ["GPT2LMHeadModel"],
                "model_type": "gpt2",
                "n_embd": self.hidden_size,
                "n_inner": self.intermediate_size,
                "n_layer": self.num_hidden_layers,
                "n_head": self.num_attention_heads,
                "n_positions": self.max_positions,
                "vocab_size": self.vocab_size,
                "tie_word_embeddings": True,
                "torch_dtype": torch_dtype,
            }
        if self.model_type == "bert":
            return {
                "architectures": ["BertForMaskedLM"],
                "model_type": "bert",
                "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_hidden_layers,
                "num_attention_heads": self.num_attention_heads,
                "max_position_embeddings": self.max_positions,
                "type_vocab_size": 2,
                "vocab_size": self.vocab_size,
                "torch_dtype": torch_dtype,
            }
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[self.model_type]
        return {
            "architectures": [arch],
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": 256,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "torch_dtype": torch_dtype,
            "bos_token_id": 1,
            "eos_token_id": 2,
        }


def decoder_tensors(cfg: ArchConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Llama / Qwen2 decoder layout (Qwen2 adds q/k/v biases)."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    kv = cfg.num_key_value_heads * cfg.head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
        ]
        if cfg.model_type == "qwen2":
            out += [
                (p + "self_attn.q_proj.bias", (h,)),
                (p + "self_attn.k_proj.bias", (kv,)),
                (p + "self_attn.v_proj.bias", (kv,)),
            ]
        out += [
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
        ]
    out.append(("model.norm.weight", (h,)))
    if not cfg.tie_word_embeddings:
        out.append(("lm_head.weight", (v, h)))
    return out


def gpt2_tensors(cfg: ArchConfig) -> list[tuple[str, tuple[int, ...]]]:
    """GPT-2 layout (Conv1D weights stored in x out; the LM head is tied to ``wte``, not stored)."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    out: list[tuple[str, tuple[int, ...]]] = [
        ("transformer.wte.weight", (v, h)),
        ("transformer.wpe.weight", (cfg.max_positions, h)),
    ]
    for layer in range(cfg.num_hidden_layers):
        p = f"transformer.h.{layer}."
        out += [
            (p + "ln_1.weight", (h,)),
            (p + "ln_1.bias", (h,)),
            (p + "attn.c_attn.weight", (h, 3 * h)),
            (p + "attn.c_attn.bias", (3 * h,)),
            (p + "attn.c_proj.weight", (h, h)),
            (p + "attn.c_proj.bias", (h,)),
            (p + "ln_2.weight", (h,)),
            (p + "ln_2.bias", (h,)),
            (p + "mlp.c_fc.weight", (h, i)),
            (p + "mlp.c_fc.bias", (i,)),
            (p + "mlp.c_proj.weight", (i, h)),
            (p + "mlp.c_proj.bias", (h,)),
        ]
    out += [("transformer.ln_f.weight", (h,)), ("transformer.ln_f.bias", (h,))]
    return out


def bert_tensors(cfg: ArchConfig) -> list[tuple[str, tuple[int, ...]]]:
    """BERT encoder layout with its pooler (``bert.embeddings.*``, ``bert.encoder.layer.N.*``)."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    e = "bert.embeddings."
    out: list[tuple[str, tuple[int, ...]]] = [
        (e + "word_embeddings.weight", (v, h)),
        (e + "position_embeddings.weight", (cfg.max_positions, h)),
        (e + "token_type_embeddings.weight", (2, h)),
        (e + "LayerNorm.weight", (h,)),
        (e + "LayerNorm.bias", (h,)),
    ]
    for layer in range(cfg.num_hidden_layers):
        p = f"bert.encoder.layer.{layer}."
        for m in ("query", "key", "value"):
            out += [(p + f"attention.self.{m}.weight", (h, h)), (p + f"attention.self.{m}.bias", (h,))]
        out += [
            (p + "attention.output.dense.weight", (h, h)),
            (p + "attention.output.dense.bias", (h,)),
            (p + "attention.output.LayerNorm.weight", (h,)),
            (p + "attention.output.LayerNorm.bias", (h,)),
            (p + "intermediate.dense.weight", (i, h)),
            (p + "intermediate.dense.bias", (i,)),
            (p + "output.dense.weight", (h, i)),
            (p + "output.dense.bias", (h,)),
            (p + "output.LayerNorm.weight", (h,)),
            (p + "output.LayerNorm.bias", (h,)),
        ]
    out += [("bert.pooler.dense.weight", (h, h)), ("bert.pooler.dense.bias", (h,))]
    return out


ARCHITECTURES: dict[str, Callable[[ArchConfig], list[tuple[str, tuple[int, ...]]]]] = {
    "llama": decoder_tensors,
    "qwen2": decoder_tensors,
    "gpt2": gpt2_tensors,
    "bert": bert_tensors,
}


@dataclass
class DeltaModel:
    """How the fine-tune differs from the base, per matrix."""

    rank: int = 4  # directions of task signal
    signal: float = 6.0  # signal strengths, in units of the noise bulk edge (top direction)
    noise: float = 2e-3  # i.i.d. noise std per entry
    weight_std: float = 0.02  # base weights' std
    vector_change: float = 1e-3  # std of the change of 1-D tensors
    strengths: list[float] = field(default_factory=list)  # explicit, overrides ``signal``
    decay: float = 0.0  # weight decay: each fine-tuned matrix is (1 − decay)·W_base + signal + noise


def _gen(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


def base_tensor(name: str, shape: tuple[int, ...], seed: int, dm: DeltaModel) -> torch.Tensor:
    g = _gen(seed, "base:" + name)
    if len(shape) == 1:
        if name.endswith("norm.weight"):
            return 1.0 + 0.05 * torch.randn(shape, generator=g, dtype=torch.float64)
        return 0.02 * torch.randn(shape, generator=g, dtype=torch.float64)
    return dm.weight_std * torch.randn(shape, generator=g, dtype=torch.float64)


def signal_and_noise(
    name: str, shape: tuple[int, ...], seed: int, dm: DeltaModel
) -> tuple[torch.Tensor, torch.Tensor]:
    """The planted low-rank signal and the i.i.d. noise of one matrix (float64)."""
    g = _gen(seed, "delta:" + name)
    m, n = shape
    noise = dm.noise * torch.randn((m, n), generator=g, dtype=torch.float64)
    k = min(dm.rank, m, n)
    if k == 0:
        return torch.zeros((m, n), dtype=torch.float64), noise
    u, _ = torch.linalg.qr(torch.randn((m, k), generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn((n, k), generator=g, dtype=torch.float64))
    edge = dm.noise * (math.sqrt(m) + math.sqrt(n))
    if dm.strengths:
        s = torch.tensor(dm.strengths[:k], dtype=torch.float64)
    else:
        s = torch.tensor([dm.signal / (1 + 0.5 * j) for j in range(k)], dtype=torch.float64)
    s = torch.clamp(s, min=0.0) * edge
    return (u * s) @ v.T, noise


def ft_tensor(
    name: str, shape: tuple[int, ...], base: torch.Tensor, seed: int, dm: DeltaModel
) -> torch.Tensor:
    if len(shape) == 1:
        g = _gen(seed, "delta:" + name)
        return base + dm.vector_change * torch.randn(shape, generator=g, dtype=torch.float64)
    sig, noise = signal_and_noise(name, shape, seed, dm)
    return (base if dm.decay == 0.0 else (1.0 - dm.decay) * base) + sig + noise


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def write_checkpoint(
    directory: Path,
    tensors: list[tuple[str, torch.Tensor]],
    *,
    shards: int = 1,
    config: dict | None = None,
    extra_files: dict[str, str] | None = None,
) -> list[str]:
    """Write tensors as ``shards`` safetensors files (+ index when sharded) and a config."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = [n for n, _ in tensors]
    per = math.ceil(len(tensors) / shards)
    files = []
    weight_map = {}
    total = 0
    for s in range(shards):
        part = tensors[s * per : (s + 1) * per]
        if not part:
            continue
        fname = "model.safetensors" if shards == 1 else f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: t.contiguous() for n, t in part}, str(directory / fname), metadata={"format": "pt"})
        files.append(fname)
        for n, t in part:
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    if shards > 1:
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config, indent=2))
    for fname, text in (extra_files or {}).items():
        (directory / fname).write_text(text)
    assert len(weight_map) == len(names)
    return files


def make_pair(
    root: Path,
    cfg: ArchConfig | None = None,
    *,
    dtype: str = "float32",
    base_shards: int = 1,
    ft_shards: int = 3,
    seed: int = 0,
    delta: DeltaModel | None = None,
    ft_vocab: int | None = None,
    ft_files: dict[str, str] | None = None,
    base_files: dict[str, str] | None = None,
    delta_seed: int | None = None,
) -> tuple[Path, Path]:
    """Write ``root/base`` and ``root/ft``; returns their paths.

    ``ft_vocab`` resizes the fine-tune's embeddings (new rows random). Values are generated
    in float64 and rounded once to ``dtype``. ``delta_seed`` (default: ``seed``) seeds the
    fine-tune's change alone, so several fine-tunes of one base are ``make_pair`` calls with
    the same ``seed`` and different ``delta_seed``s.
    """
    cfg = cfg or ArchConfig()
    dm = delta or DeltaModel()
    tdtype = _DTYPES[dtype]
    layout = ARCHITECTURES[cfg.model_type](cfg)
    base_list, ft_list = [], []
    for name, shape in layout:
        b = base_tensor(name, shape, seed, dm)
        f = ft_tensor(name, shape, b, seed if delta_seed is None else delta_seed, dm)
        if (
            ft_vocab is not None
            and len(shape) == 2
            and shape[0] == cfg.vocab_size
            and ft_vocab != cfg.vocab_size
        ):
            g = _gen(seed, "resize:" + name)
            if ft_vocab > cfg.vocab_size:
                extra = dm.weight_std * torch.randn(
                    (ft_vocab - cfg.vocab_size, shape[1]), generator=g, dtype=torch.float64
                )
                f = torch.cat([f, extra], dim=0)
            else:
                f = f[:ft_vocab]
        base_list.append((name, b.to(tdtype)))
        ft_list.append((name, f.to(tdtype)))
    base_dir, ft_dir = Path(root) / "base", Path(root) / "ft"
    write_checkpoint(base_dir, base_list, shards=base_shards, config=cfg.to_hf(dtype), extra_files=base_files)
    ft_cfg = cfg.to_hf(dtype)
    if ft_vocab is not None:
        ft_cfg["vocab_size"] = ft_vocab
    write_checkpoint(ft_dir, ft_list, shards=ft_shards, config=ft_cfg, extra_files=ft_files)
    return base_dir, ft_dir
