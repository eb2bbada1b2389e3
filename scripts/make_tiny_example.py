#!/usr/bin/env python3
"""Build ``examples/tiny``: a small Llama-shaped base/fine-tune pair, and measure a repair of it.

The fine-tune is the base plus, on every matrix, a rank-4 task signal and i.i.d. noise of the
kind the DG-Hard paper attributes to SGD (``dghard_cli.testing.synthetic``). Because the signal is
known, the effect of a repair can be measured exactly: how much closer the repaired update is
to the planted signal than the fine-tune's update is.

    python scripts/make_tiny_example.py                 # (re)write examples/tiny
    python scripts/make_tiny_example.py --evaluate OUT  # compare a repaired OUT with the truth

The pair is deterministic (fixed seed); it ships a byte-level tokenizer, a generation config and
a chat template so the output's side files can be checked, and loads in ``transformers``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dghard_cli.testing.synthetic import ArchConfig, DeltaModel, make_pair, signal_and_noise  # noqa: E402

CFG = ArchConfig(
    model_type="llama",
    hidden_size=128,
    intermediate_size=344,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)
DELTA = DeltaModel(rank=4, signal=4.0, noise=1.5e-3, weight_std=0.02)
SEED = 2026
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SAMPLE_TEXT = (
    "dghard repairs catastrophic forgetting in fine-tuned checkpoints after the fact. "
    "The fine-tuning update of every weight matrix is a low-rank task signal plus a noise "
    "residue; hard-thresholding its singular values keeps the signal and drops the noise. "
) * 20


def tokenizer_files(vocab_size: int) -> dict[str, str]:
    """A byte-level BPE tokenizer of exactly ``vocab_size`` entries, as transformers files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin|>", "<|end|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([SAMPLE_TEXT], trainer=trainer)
    while tok.get_vocab_size() < vocab_size:
        tok.add_tokens([f"<|extra_{tok.get_vocab_size()}|>"])
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin|>",
        "eos_token": "<|end|>",
        "model_max_length": 256,
        "clean_up_tokenization_spaces": False,
    }
    return {
        "tokenizer.json": tok.to_str(),
        "tokenizer_config.json": json.dumps(config, indent=2),
        "special_tokens_map.json": json.dumps({"bos_token": "<|begin|>", "eos_token": "<|end|>"}, indent=2),
        "chat_template.jinja": CHAT_TEMPLATE,
        "generation_config.json": json.dumps(
            {"bos_token_id": 0, "eos_token_id": 1, "max_new_tokens": 32}, indent=2
        ),
    }


def build(dest: Path) -> None:
    tmp = dest.parent / (dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    files = tokenizer_files(CFG.vocab_size)
    base, ft = make_pair(
        tmp,
        CFG,
        dtype="bfloat16",
        base_shards=1,
        ft_shards=3,
        seed=SEED,
        delta=DELTA,
        ft_files=files,
        base_files=files,
    )
    for d in (base, ft):
        cfg = json.loads((d / "config.json").read_text())
        cfg.update({"bos_token_id": 0, "eos_token_id": 1})
        (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    # the fine-tune's own generation settings differ from the base's
    gen = json.loads((ft / "generation_config.json").read_text())
    gen["temperature"] = 0.7
    (ft / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(f"wrote {dest} ({size / 1e6:.1f} MB)")


def evaluate(example: Path, repaired: Path) -> dict:
    """Distance of each update to the planted task signal: fine-tune vs repaired."""
    sys.path.insert(0, str(REPO / "tests"))
    from safetensors.torch import load_file

    def load(d: Path) -> dict[str, torch.Tensor]:
        out = {}
        for p in sorted(d.glob("*.safetensors")):
            out.update(load_file(str(p)))
        return out

    b, f, r = load(example / "base"), load(example / "ft"), load(repaired)
    rows = []
    err_ft_sum = err_rep_sum = sig_sum = 0.0
    for name, t in b.items():
        if t.ndim != 2:
            continue
        sig, _ = signal_and_noise(name, tuple(t.shape), SEED, DELTA)
        d_ft = f[name].double() - t.double()
        d_rep = r[name].double() - t.double()
        e_ft = float(torch.linalg.norm(d_ft - sig))
        e_rep = float(torch.linalg.norm(d_rep - sig))
        rows.append((name, e_ft, e_rep))
        err_ft_sum += e_ft**2
        err_rep_sum += e_rep**2
        sig_sum += float(torch.linalg.norm(sig)) ** 2
    result = {
        "matrices": len(rows),
        "ft_error": (err_ft_sum / sig_sum) ** 0.5,
        "repaired_error": (err_rep_sum / sig_sum) ** 0.5,
    }
    result["improvement"] = result["ft_error"] / result["repaired_error"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dest", type=Path, default=REPO / "examples" / "tiny")
    ap.add_argument("--evaluate", type=Path, metavar="OUT", help="a repaired output directory to compare")
    args = ap.parse_args()
    if args.evaluate:
        res = evaluate(args.dest, args.evaluate)
        print(
            f"distance of the update to the planted task signal (relative to the signal), {res['matrices']} matrices:\n"
            f"  fine-tune: {res['ft_error']:.3f}\n  repaired:  {res['repaired_error']:.3f}\n"
            f"  the repaired update is {res['improvement']:.1f}x closer to the task signal"
        )
        return
    build(args.dest)


if __name__ == "__main__":
    main()
