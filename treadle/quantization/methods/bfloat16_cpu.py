"""Float checkpoints in ``--dtype bfloat16`` on the CPU: the weights of the linear layers stay
bfloat16 (half the bytes of float32) and multiply on Treadle's C kernel (``csrc/bf16matmul.c``:
each bfloat16 widened to float32 in registers, float32 fused multiply-adds), not on torch's
bfloat16 matmul, which on a CPU without AVX-512 BF16 runs an order of magnitude slower than its
float32 one.

The activations stay float32 (``activation_dtype``): every other op of the model -- norms, RoPE,
attention, SwiGLU -- runs on the float32 kernels it runs on in a float32 model (eager bfloat16
elementwise ops would cost more than the matmuls save), and the decoder layers qualify for the
one-call C layer (``treadle.worker.fused_layers``: bfloat16 rows are a ``tq_layout`` segment type).
So a bfloat16 model computes what the float32 model with bfloat16-rounded weights computes, up
to summation order; the KV cache still holds bfloat16 (the engine's ``kv_cache_dtype`` auto). A
row's result does not depend on its batch.
"""
from __future__ import annotations

import torch
from torch import nn

from treadle.kernels import native
from treadle.layers.linear import Linear, UnquantizedLinearMethod, load_rows
from treadle.quantization import MethodFactory


class BFloat16CPUMethod(UnquantizedLinearMethod):
    """A plain float linear layer whose weight is held in bfloat16 whatever the model's
    (float32) activation dtype, and multiplies on the C kernel (CPU inputs, an input width
    divisible by 8; anything else goes to torch, in float32, one row at a time so that a row's
    result does not depend on its batch either). Output: float32."""

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=torch.bfloat16),
                              requires_grad=False)
        weight.weight_loader = lambda p, t, s=None: load_rows(layer, p, t, s)  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)

    @staticmethod
    def on_kernel(layer: Linear) -> bool:
        """Whether the layer's weight is one the C kernel (and the C decoder layer) takes."""
        w = layer.weight
        return w.dtype is torch.bfloat16 and w.is_contiguous() and layer.in_features % 8 == 0 and w.is_cpu

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if not (x.is_cpu and self.on_kernel(layer)):
            bias = None if layer.bias is None else layer.bias.float()
            w = layer.weight.float()
            if not x.is_cpu or x.dim() < 2:
                return torch.nn.functional.linear(x.float(), w, bias)
            # one row at a time, each copied to its own (aligned) buffer: torch's CPU matmul rounds a
            # row differently with other rows beside it, or at another alignment
            rows = x.float().reshape(-1, x.shape[-1])
            out = torch.cat([torch.nn.functional.linear(r.clone(), w, bias) for r in rows.split(1)])
            return out.reshape(*x.shape[:-1], out.shape[-1])
        return native.bf16_matmul(x, layer.weight, layer.bias, torch.float32)


def bfloat16_on_cpu_kernels(dtype: torch.dtype, device: str | torch.device) -> bool:
    """Whether a model of ``dtype`` on ``device`` runs as described above (bfloat16 weights,
    float32 activations): a bfloat16 model on the CPU with the kernels built."""
    return dtype is torch.bfloat16 and torch.device(device).type == "cpu" and native.available()


def activation_dtype(dtype: torch.dtype, device: str | torch.device) -> torch.dtype:
    """The dtype a model of ``dtype`` computes in: float32 for bfloat16 on the CPU kernels."""
    return torch.float32 if bfloat16_on_cpu_kernels(dtype, device) else dtype


def bfloat16_cpu_factory(inner: MethodFactory | None, dtype: torch.dtype,
                         device: str | torch.device) -> MethodFactory | None:
    """``inner`` with its float layers (those it leaves to the plain method: all of them when it
    is None) on BFloat16CPUMethod, when ``bfloat16_on_cpu_kernels``; ``inner`` unchanged otherwise."""
    if not bfloat16_on_cpu_kernels(dtype, device):
        return inner
    return lambda name: (inner(name) if inner is not None else None) or BFloat16CPUMethod()
