"""Files in and out: the safetensors format, checkpoint reading, Hub sources, LoRA adapters on disk, the output stage, verify."""
