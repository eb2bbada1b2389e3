"""README.md of an adapter output (the model card a Hub upload shows)."""

from __future__ import annotations


def adapter_card(doc: dict) -> str:
    """README.md of an adapter output: what was done and how to load it."""
    a = doc.get("adapter", {})
    base = a.get("base_model_name_or_path") or doc["inputs"]["base"]["source"]
    given = doc["inputs"]["base"]["source"]
    if a.get("base_reference") == "absolute path":
        where = f"BASE (`{given}` on the command line) is recorded as the absolute path `{base}`; "
        where += "copy the base there, or edit `base_model_name_or_path` in adapter_config.json, to load it elsewhere"
    else:
        where = f"BASE is the Hugging Face Hub model `{base}`"
    mib = (a.get("bytes") or 0) / 2**20
    full = (a.get("full_checkpoint_bytes") or 0) / 2**20
    lines = [
        "---",
        "library_name: peft",
        f"base_model: {base}",
        "tags:",
        "- dghard",
        f"- {doc['method']}",
        "---",
        "",
        f"# {doc['method']} as a PEFT LoRA adapter",
        "",
        f"Made by `dghard {doc['command']}` (dghard {doc['tool']['version']}) on {doc['created']}.",
        "",
        f"- {a.get('lora_modules', 0)} LoRA modules (rank median {a.get('rank_median')}, max {a.get('rank_max')}; "
        f"scaling 1), {a.get('full_tensors', 0)} full tensors"
        + (f" (modules_to_save: {', '.join(a['modules_to_save'])})" if a.get("modules_to_save") else ""),
        f"- base model: {where}",
        f"- {mib:.2f} MiB, against {full:.2f} MiB for the full checkpoint",
        f"- largest share of a module's update lost to the rank cut: {a.get('energy_lost_max', 0):.3g}",
        (
            "- exact: every module keeps its whole update"
            if a.get("exact", True)
            else f"- LOSSY (asked for by {a.get('cut_by')}): keeps {100 * a.get('energy_kept', 0):.1f} % of the "
            "update's energy; the exact model is the run with --merge"
        ),
        *(["- DoRA (use_dora): each module has its magnitude vector"] if a.get("dora") else []),
        *(
            [f"- layer-wise strengths λ(ℓ): {doc['layer_strengths']['summary']}"]
            if doc.get("layer_strengths")
            else []
        ),
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        "from peft import PeftModel",
        "",
        f"model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({base!r}), 'THIS_DIR')",
        "merged = model.merge_and_unload()  # a plain transformers model",
        "```",
        "",
        "`dghard_report.json` holds every module's rank, energy and timings.",
        "",
    ]
    return "\n".join(lines)
