"""Convert q/k projection rows from the interleaved RoPE layout to rotate-half.

Meta's original Llama code and llama2.c rotate ADJACENT pairs of each head's
dimensions; Hugging Face Llama rotates the first half against the second half.
GGUF writers (llama.cpp's convert script) permute HF rows back to the adjacent
layout, so GGUF and llama2.c weights both need this same fix on load::

    per head, rows in interleaved order:  p0.a p0.b p1.a p1.b ... (pair i = dims 2i, 2i+1)
    rotate-half order:                    p0.a p1.a ... | p0.b p1.b ...

It moves whole rows, so it works on any row-major tensor whose first axis is the
output features: float weights, biases, or rows of quantized blocks.
"""
from __future__ import annotations

import torch


def interleaved_to_rotate_half(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """rows [num_heads * head_dim, ...] -> same shape, each head's rows reordered."""
    out_features = rows.shape[0]
    if out_features % (2 * num_heads):
        raise ValueError(f"{out_features} rows do not split into {num_heads} heads of even size")
    half = out_features // num_heads // 2
    return rows.reshape(num_heads, half, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape).contiguous()
