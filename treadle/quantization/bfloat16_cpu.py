"""Float checkpoints in ``--dtype bfloat16`` on the CPU: the weights stay bfloat16 (half the bytes
of float32) and multiply on Treadle's C kernel (``csrc/bf16matmul.c``: each bfloat16 widened to
float32 in registers, float32 fused multiply-adds), not on torch's bfloat16 matmul, which on a
CPU without AVX-512 BF16 runs an order of magnitude slower than its float32 one.

The product is the float32 product of the same bfloat16 weights and activations, rounded to
bfloat16 on the way out as torch's is (both conversions inside the C call); the vocabulary
layer (lm_head, or the tied embedding) returns its logits in float32 unrounded. A row's result
does not depend on its batch.
"""
from __future__ import annotations

import torch

from treadle.kernels import native
from treadle.layers.linear import Linear, UnquantizedLinearMethod
from treadle.quantization import MethodFactory

VOCAB_LAYERS = ("lm_head", "model.embed_tokens")  # their output: logits, kept float32


class BFloat16CPUMethod(UnquantizedLinearMethod):
    """A plain float linear layer whose bfloat16 weight multiplies on the C kernel (CPU inputs
    with an input width divisible by 8; anything else goes to torch as before). ``float_out``:
    return float32 (the logits), else x's dtype."""

    def __init__(self, float_out: bool = False) -> None:
        self.float_out = float_out

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        w = layer.weight
        if w.dtype is not torch.bfloat16 or not x.is_cpu or layer.in_features % 8 or not w.is_contiguous():
            return super().apply(layer, x)
        return native.bf16_matmul(x, w, layer.bias, torch.float32 if self.float_out else x.dtype)


def bfloat16_cpu_factory(inner: MethodFactory | None, dtype: torch.dtype,
                         device: str | torch.device) -> MethodFactory | None:
    """``inner`` with its float layers (those it leaves to the plain method: all of them when it
    is None) on BFloat16CPUMethod, for a bfloat16 model on the CPU with the kernels built;
    ``inner`` unchanged otherwise."""
    if dtype is not torch.bfloat16 or torch.device(device).type != "cpu" or not native.available():
        return inner
    return lambda name: (inner(name) if inner is not None else None) or BFloat16CPUMethod(name in VOCAB_LAYERS)
