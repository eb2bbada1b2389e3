"""The PEFT LoRA adapter format: an adapter read (its config, targets and tensors, viewed as FT),
a run written as an adapter (the output decisions, the exact and factored routes, PEFT's layout,
the staged files, the model card, DoRA kept as DoRA, the check of a written adapter), and the spectra of LoRA updates the audit measures."""
