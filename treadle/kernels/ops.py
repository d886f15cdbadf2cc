"""Python faces of ``csrc/ops.c``: RMSNorm with the residual add, in-place RoPE, SwiGLU and GeGLU,
one C call each. ``usable`` says whether a tensor can go to them (float32 on the CPU, rows
with unit stride, kernels built); the layers fall back to plain torch otherwise."""
from __future__ import annotations

import torch

from treadle.kernels import native


def usable(*tensors: torch.Tensor) -> bool:
    if not native.available():
        return False
    for t in tensors:  # a plain loop: this runs several times per layer per step
        if t.dtype is not torch.float32 or not t.is_cpu or t.stride(-1) != 1:
            return False
    return True


def rms_norm(
    x: torch.Tensor,  # [T, hidden] (rows may be strided)
    residual: torch.Tensor | None,  # [T, hidden] contiguous; becomes x + residual
    weight: torch.Tensor,  # [hidden] float32
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight, x + residual), the sum written into ``residual``."""
    x2 = x.view(-1, x.shape[-1]) if x.dim() != 2 else x
    out = torch.empty(x2.shape, dtype=torch.float32)
    native.kernel("tq_rms_norm")(
        x2.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
        x2.shape[0], x2.shape[1], x2.stride(0), eps,
    )
    return out.view(x.shape), (x if residual is None else residual)


def rope_(
    x: torch.Tensor,  # [T, heads, head_dim], heads contiguous within a row
    cos_sin: torch.Tensor,  # [max_positions, head_dim] float32
    positions: torch.Tensor,  # [T] int64
) -> None:
    """Rotate-half RoPE applied in place."""
    t, heads, d = x.shape
    native.kernel("tq_rope")(x.data_ptr(), cos_sin.data_ptr(), positions.data_ptr(), t, heads, d, x.stride(0))


def _gated(kernel: str, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 d] -> [T, d]
    g2 = gate_up.view(-1, gate_up.shape[-1]) if gate_up.dim() != 2 else gate_up
    d = g2.shape[1] // 2
    out = torch.empty(g2.shape[0], d, dtype=torch.float32)
    native.kernel(kernel)(g2.data_ptr(), out.data_ptr(), g2.shape[0], d, g2.stride(0))
    return out.view(*gate_up.shape[:-1], d)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 d] -> [T, d], SwiGLU
    return _gated("tq_silu_mul", gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 d] -> [T, d], GeGLU (tanh GELU)
    return _gated("tq_gelu_tanh_mul", gate_up)
