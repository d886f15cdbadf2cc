"""Run-time quantization methods: what a linear layer holds and how it multiplies, chosen per
layer at load time (GGUF blocks on the C kernels, bfloat16 / float32 rows on the CPU, torch's
packed int4 / int8, W8A8, and their GPU counterparts on Triton)."""
