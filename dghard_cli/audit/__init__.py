"""``dghard audit-lora``: checks of a PEFT LoRA adapter and their findings."""
