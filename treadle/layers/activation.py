"""Gated activations over the fused gate_up projection: SwiGLU (silu(gate) * up) and GeGLU."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from treadle.kernels import ops
from treadle.layers.fused import triton_ops


def silu_and_mul_plain(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] -> [..., d] (oracle)"""
    d = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :d]) * gate_up[..., d:]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] -> [..., d]; the product is taken in place in silu's output, so one
    temporary instead of two (same arithmetic as the plain version, bit for bit). Float32
    on the CPU: one C call (exp approximated to < 2e-7 relative); CUDA: one Triton launch."""
    if ops.usable(gate_up):
        return ops.silu_mul(gate_up)
    if (gpu := triton_ops(gate_up)) is not None:
        return gpu.gated(gate_up, gelu=False)
    d = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :d]).mul_(gate_up[..., d:])


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): gelu(gate, tanh approximation) * up; [..., 2 * d] -> [..., d]. Float32 on
    the CPU: one C call (the one the fused Gemma layer makes; exp approximated as for SwiGLU)."""
    if ops.usable(gate_up):
        return ops.gelu_tanh_mul(gate_up)
    if (gpu := triton_ops(gate_up)) is not None:
        return gpu.gated(gate_up, gelu=True)
    d = gate_up.shape[-1] // 2
    return F.gelu(gate_up[..., :d], approximate="tanh").mul_(gate_up[..., d:])
