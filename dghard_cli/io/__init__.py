"""Files in and out: the safetensors format, checkpoint reading, Hub sources, the output stage, verify."""
