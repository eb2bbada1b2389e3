#!/usr/bin/env python3
"""Load the outputs of docs/lora.md's workflow with transformers and PEFT and compare logits.

Run in the example directory after the commands of docs/lora.md (and ``dghard repair base full-ft
repaired-full``, ``dghard merge --method wise-ft --alpha 0.5 base adapter --out half-full --merge``):
prints the largest absolute logit difference on 4 x 32 random tokens of

- ``merged`` (``dghard merge --merge``) against PEFT's own ``merge_and_unload()``;
- the adapter ``adapter-half`` loaded with ``PeftModel.from_pretrained`` against ``half-full``;
- the adapter ``repaired-adapter`` (``--format peft``) against the full repair ``repaired-full``.

    cd /tmp/lora-example && python /path/to/dghard/scripts/check_lora_example.py
"""

from __future__ import annotations

import warnings

import torch


def main() -> None:
    warnings.filterwarnings("ignore")
    import transformers
    from peft import PeftModel
    from transformers import AutoModelForCausalLM as Model

    transformers.logging.set_verbosity_error()
    x = torch.randint(0, 2048, (4, 32), generator=torch.Generator().manual_seed(0))

    def logits(m) -> torch.Tensor:
        with torch.no_grad():
            return m.eval()(x).logits

    def peft(adapter: str):
        return PeftModel.from_pretrained(Model.from_pretrained("base"), adapter)

    ref = peft("adapter").merge_and_unload()
    rows = [
        ("merged       vs PEFT merge_and_unload", logits(Model.from_pretrained("merged")), logits(ref)),
        (
            "adapter-half vs --merge of the same  ",
            logits(peft("adapter-half")),
            logits(Model.from_pretrained("half-full")),
        ),
        (
            "repaired-adapter vs repaired-full    ",
            logits(peft("repaired-adapter")),
            logits(Model.from_pretrained("repaired-full")),
        ),
    ]
    for label, a, b in rows:
        print(f"{label}: {(a - b).abs().max().item():.3g}")
    print(f"logits scale                         : {logits(ref).abs().max().item():.3g}")


if __name__ == "__main__":
    main()
