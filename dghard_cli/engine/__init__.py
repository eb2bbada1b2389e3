"""The streaming engine: the tensor plan, the read → compute → write pipeline, the runner, progress, device, memory."""
