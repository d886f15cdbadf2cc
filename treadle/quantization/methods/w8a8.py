"""W8A8: int8 weights (one scale per output channel) times int8 activations quantized
dynamically per token, as compressed-tensors' ``int-quantized`` scheme defines them::

    xs[m] = max|x[m, :]| / 127.5 (FLT_EPSILON when 0),   xq = round(clamp(x / xs, -128, 127))
    y[m, n] = float(sum_k xq[m, k] * w[n, k]) * xs[m] * ws[n]  (+ bias[n])

The sums are exact int32. Treadle's C kernel (``csrc/w8a8.c``) runs it on the CPU; without
the kernels, ``w8a8_reference`` -- plain torch, an int32 matmul -- gives the same bits (tests
check that; ``torch._int_mm`` is not used, it has overflowed on some CPUs). Weights on a CUDA
device run the Triton kernels of ``gpu.py`` (same rule, same bits under the interpreter); the
choice is made once, after loading, from the weight's device.

Under tensor parallelism a row-parallel layer (o_proj, down_proj) holds the input columns of
its rank and the per-channel scales whole; each rank quantizes its own slice of a token's
activations with its own per-token scale (no cross-rank max), so results differ from one
rank's by that rounding (tokens identical in the tests; log-probabilities within 0.25 on a tiny
random model, whose activation rounding alone moves them by 0.2).
"""
from __future__ import annotations

import torch
from torch import nn

from treadle.kernels import native
from treadle.layers.linear import Linear, LinearMethod, load_rows
from treadle.quantization.methods.gpu import Kernels, kernels_for, w8a8_matmul

_EPS = torch.finfo(torch.float32).eps


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (xq [M, K] int8, xs [M] float32), the rule above."""
    xs = x.abs().amax(-1) / 127.5
    xs = torch.where(xs == 0, torch.full_like(xs, _EPS), xs)
    xq = torch.round(torch.clamp(x / xs[:, None], -128, 127)).to(torch.int8)
    return xq, xs


def w8a8_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32, weight [N, K] int8, weight_scale [N] float32 -> [..., N] float32."""
    flat = x.reshape(-1, x.shape[-1]).float()
    xq, xs = quantize_per_token(flat)
    acc = torch.matmul(xq.to(torch.int32), weight.to(torch.int32).t())  # exact integer sums
    y = acc.to(torch.float32) * xs[:, None]
    y = y * weight_scale[None, :]
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.shape[0])


def _tensor(layer: Linear, name: str) -> torch.Tensor:
    """The layer's ``weight_scale`` or ``weight_sums`` (registered by W8A8Method)."""
    t = getattr(layer, name)
    assert isinstance(t, torch.Tensor)
    return t


class W8A8Method(LinearMethod):
    """A layer of int8 ``weight`` [out, in] and float ``weight_scale`` [out, 1] (compressed-tensors
    names; shards of a fused layer stacked row-wise)."""

    def __init__(self) -> None:
        self.kernels: Kernels = "cpu"  # set from the weight's device after loading (``use``)

    def use(self, kernels: Kernels) -> None:
        """Run on ``kernels``: "cpu" (C kernels, or the torch reference without them) or
        "triton" (CUDA tensors; CPU tensors only under TRITON_INTERPRET, as the tests run it)."""
        self.kernels = kernels

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=torch.int8),
                              requires_grad=False)
        scale = nn.Parameter(torch.empty(layer.out_features, 1), requires_grad=False)  # [out, 1] float32
        for p in (weight, scale):
            p.weight_loader = lambda p, t, s=None: load_rows(layer, p, t.to(p.dtype), s)  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)
        layer.register_parameter("weight_scale", scale)

    def process_weights_after_loading(self, layer: Linear) -> None:
        scale = _tensor(layer, "weight_scale")
        layer.weight_scale = nn.Parameter(scale.reshape(-1).contiguous(), requires_grad=False)  # [out]
        layer.register_buffer("weight_sums", native.w8a8_weight_sums(layer.weight))  # [out] int32 (C kernels)
        self.use(kernels_for(layer.weight.device))

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        bias = None if layer.bias is None else layer.bias.float().contiguous()
        scale = _tensor(layer, "weight_scale")
        if self.kernels == "triton":
            y = w8a8_matmul(x, layer.weight, scale, bias)
        elif native.available():
            y = native.w8a8_matmul(x, layer.weight, scale, bias, weight_sums=_tensor(layer, "weight_sums"))
        else:
            y = w8a8_reference(x, layer.weight, scale, bias)
        return y.to(x.dtype)
