"""RMSNorm, with the residual add fused into the same call."""
from __future__ import annotations

import torch
from torch import nn

from treadle.kernels import ops
from treadle.layers.fused import fused_ops_enabled, triton_ops


def rms_norm_plain(
    x: torch.Tensor,  # [..., hidden]
    residual: torch.Tensor | None,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place oracle: (norm(x + residual), x + residual), Hugging Face arithmetic."""
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype), x


def rms_norm_fused(
    x: torch.Tensor,  # [..., hidden]
    residual: torch.Tensor | None,  # [..., hidden]; overwritten with x + residual
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same values as ``rms_norm_plain`` in fewer calls (one C call for float32 on the
    CPU, one Triton launch for CUDA tensors); the sum is written into ``residual`` in place (the caller hands its residual
    stream over)."""
    if ops.usable(x, weight) and (residual is None or (ops.usable(residual) and residual.is_contiguous())):
        return ops.rms_norm(x, residual, weight, eps)
    gpu = triton_ops(x)
    if gpu is not None and (residual is None or residual.is_contiguous()):
        return gpu.rms_norm(x, residual, weight, eps)
    if residual is not None:
        x = residual.add_(x)
    if x.dtype == torch.float32:
        inv = x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
        return (x * inv).mul_(weight), x
    x32 = x.float()
    inv = x32.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return weight * x32.mul_(inv).to(x.dtype), x


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, fused: bool | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.fused = fused_ops_enabled() if fused is None else fused

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (norm(x + residual), x + residual); residual None means x itself.
        With fused ops on, ``residual`` is updated in place and returned."""
        if self.fused:
            return rms_norm_fused(x, residual, self.weight, self.eps)
        return rms_norm_plain(x, residual, self.weight, self.eps)
