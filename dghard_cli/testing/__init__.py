"""Synthetic checkpoints and LoRA adapters with real architecture tensor names, for tests, benchmarks and demos."""
