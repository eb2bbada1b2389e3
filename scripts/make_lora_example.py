#!/usr/bin/env python3
"""The LoRA example of docs/lora.md: a small Qwen2 base, two PEFT adapters, a full fine-tune.

Built with transformers and PEFT (``pip install 'dghard[test]'``): the base is a randomly
initialised Qwen2 (hidden 256, 4 layers, vocabulary 2048, tied embeddings); the adapters are made
with ``get_peft_model`` and random non-zero ``lora_B`` (rank 16 on the attention and MLP
projections; rank 8 on q/v), saved with ``save_pretrained``; the full fine-tune is the base plus a
rank-8 signal and i.i.d. noise on every matrix.

    python scripts/make_lora_example.py /tmp/lora-example
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    transformers.logging.set_verbosity_error()
    root = args.dir
    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=2048,
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(str(root / "base"))
    g = torch.Generator().manual_seed(1)
    for name, lora in (
        ("adapter", dict(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")),
        ("adapter2", dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")),
    ):
        model = get_peft_model(Qwen2ForCausalLM.from_pretrained(str(root / "base")), LoraConfig(**lora))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0.0, 0.02, generator=g)
        model.save_pretrained(str(root / name))
    ft = Qwen2ForCausalLM.from_pretrained(str(root / "base"))
    with torch.no_grad():
        for _, p in ft.named_parameters():
            if p.ndim == 2:
                u, v = torch.randn(p.shape[0], 8, generator=g), torch.randn(8, p.shape[1], generator=g)
                p.add_(0.002 * u @ v + 5e-4 * torch.randn(p.shape, generator=g))
            else:
                p.add_(0.01 * torch.randn(p.shape, generator=g))
    ft.save_pretrained(str(root / "full-ft"))
    print(f"wrote {root}/base, {root}/adapter, {root}/adapter2, {root}/full-ft")


if __name__ == "__main__":
    main()
