"""Checkpoint formats: how a published quantized checkpoint stores its tensors
(compressed-tensors, GPTQ, AWQ), parsed from its ``quantization_config`` into per-layer formats
that each make a run-time method (``treadle.quantization.methods``)."""
