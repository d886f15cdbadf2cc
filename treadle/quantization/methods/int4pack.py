"""Weight-only int4/int8 storage on torch's packed CPU kernels.

torch's int4 kernel (``aten._weight_int4pack_mm_for_cpu``) dequantizes on the fly::

    w[n, k] = (q[n, k] - 8) * scale[k // G, n] + zero[k // G, n]      q in 0..15

with ``scale_zeros`` stored as ``[K / G, N, 2]``. It is fast only for bfloat16
activations and bfloat16 scales (float32 activations take a scalar path ~50x slower),
so ``apply`` runs the kernel in bfloat16 and returns the caller's dtype.
The int8 kernel (``aten._weight_int8pack_mm``) is ``x @ (q * scale[n]).T`` per output row.
"""
from __future__ import annotations

import torch

KERNEL_DTYPE = torch.bfloat16


def int4_supported(out_features: int, in_features: int, group_size: int) -> bool:
    """Shapes the packed int4 kernel accepts."""
    return out_features % 16 == 0 and in_features % group_size == 0 and in_features % 32 == 0


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] integers in 0..15 -> opaque packed uint8 [N, K / 2]."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)


def scale_zeros(
    scale: torch.Tensor,  # [N, K / G]
    zero: torch.Tensor,  # [N, K / G]
) -> torch.Tensor:  # [K / G, N, 2] bfloat16
    return torch.stack((scale, zero), dim=-1).transpose(0, 1).to(KERNEL_DTYPE).contiguous()


def int4_mm(
    x: torch.Tensor,  # [..., K]
    packed: torch.Tensor,  # [N, K / 2] uint8
    group_size: int,
    sz: torch.Tensor,  # [K / G, N, 2] bfloat16
) -> torch.Tensor:  # [..., N] in x's dtype
    flat = x.reshape(-1, x.shape[-1]).to(KERNEL_DTYPE)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed, group_size, sz)
    return y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)


def int8_mm(
    x: torch.Tensor,  # [..., K]
    q: torch.Tensor,  # [N, K] int8
    scale: torch.Tensor,  # [N] bfloat16
) -> torch.Tensor:  # [..., N] in x's dtype
    flat = x.reshape(-1, x.shape[-1]).to(KERNEL_DTYPE)
    if flat.shape[-1] % 8:  # torch's kernel reads past the row (a segfault) unless K is a multiple of 8
        y = (flat.float() @ q.float().t() * scale.float()).to(KERNEL_DTYPE)
    else:
        y = torch.ops.aten._weight_int8pack_mm(flat, q, scale)
    return y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)


def quantize_int4(
    w: torch.Tensor,  # [N, K] float
    group_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [N, K] uint8, scale, zero [N, K/G] f32
    """Asymmetric min/max quantization per group of ``group_size`` inputs. The scale and
    zero are rounded to the kernel's dtype *before* q is chosen, so q is the best
    integer for the values the kernel will actually use."""
    n, k = w.shape
    g = w.float().view(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-10).to(KERNEL_DTYPE).float()
    zero = (lo + 8 * scale).to(KERNEL_DTYPE).float()
    q = torch.round((g - zero.unsqueeze(-1)) / scale.unsqueeze(-1) + 8).clamp_(0, 15)
    return q.to(torch.uint8).view(n, k), scale, zero


def dequantize_int4(
    q: torch.Tensor,  # [N, K] 0..15
    scale: torch.Tensor,  # [N, K / G]
    zero: torch.Tensor,  # [N, K / G]
) -> torch.Tensor:  # [N, K] float32, what the kernel computes with
    group = q.shape[1] // scale.shape[1]
    s = scale.to(KERNEL_DTYPE).float().repeat_interleave(group, 1)
    z = zero.to(KERNEL_DTYPE).float().repeat_interleave(group, 1)
    return (q.float() - 8) * s + z


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # q [N, K] int8, scale [N] f32
    """Symmetric per-output-channel int8; the scale is rounded to the kernel dtype first."""
    scale = (w.float().abs().amax(-1) / 127).clamp_min(1e-10).to(KERNEL_DTYPE).float()
    q = torch.round(w.float() / scale.unsqueeze(-1)).clamp_(-128, 127)
    return q.to(torch.int8), scale
