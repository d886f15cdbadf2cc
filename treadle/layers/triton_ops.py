"""The per-token operators on CUDA, one Triton launch each: RMSNorm with the residual add, SwiGLU
and GeGLU over the fused gate_up row, rotate-half RoPE in place. The torch paths in ``norm.py``,
``activation.py`` and ``rotary.py`` take 2 to 9 kernels each; a decode step of a small model on
a GPU is bound by those launches, not by its bytes (``benchmarks/gpu_engine_check.py``).

The arithmetic is the torch paths' own: float32 math, rounded to the tensor's dtype where torch
rounds (the residual sum, silu's output, each RoPE product and sum), launched without FMA
contraction. What differs: the order of RMSNorm's mean-square sum, and exp / tanh, which are
the GPU's approximations (|rel| < 2e-7 in float32). The CPU never imports this module (the
layers call it for CUDA tensors only); the tests run it in Triton's interpreter on CPU tensors
(tests/gpu/test_triton_ops.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n, stride_x, stride_r, stride_o, eps,
                     HAS_RES: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:  # x + residual in the tensor's dtype, written back as the new residual stream
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
    y = xf * inv
    if ROUND:  # 16-bit: weight * x32.to(dtype), a product of two 16-bit values rounded once
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight, x + residual), the sum written into ``residual``."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    r2 = x2 if residual is None else residual.view(-1, n)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, n, x2.stride(0), r2.stride(0), out.stride(0), eps,
            HAS_RES=residual is not None, ROUND=x.dtype != torch.float32, BLOCK=triton.next_power_of_2(n),
            enable_fp_fusion=False)
    return out.view(x.shape), (x if residual is None else residual)


@triton.jit
def _gated_kernel(gu_ptr, out_ptr, d, stride_in, stride_out, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    g = tl.load(gu_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_in + d + cols, mask=mask, other=0.0)
    if GELU:  # tanh GELU; tanh(y) = 2 sigmoid(2 y) - 1
        y = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (2.0 * tl.sigmoid(2.0 * y))
    else:
        a = g / (1.0 + tl.exp(-g))
    a = a.to(out_ptr.dtype.element_ty).to(tl.float32)  # the activation's own output, then the product
    tl.store(out_ptr + row * stride_out + cols, (a * u.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def gated(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """[..., 2 d] -> [..., d]: silu(gate) * up, or tanh-GELU(gate) * up."""
    g2 = gate_up.reshape(-1, gate_up.shape[-1])
    d = g2.shape[1] // 2
    out = torch.empty(g2.shape[0], d, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(d))
    if g2.shape[0]:
        _gated_kernel[(g2.shape[0], triton.cdiv(d, block))](g2, out, d, g2.stride(0), out.stride(0), GELU=gelu,
                                                             BLOCK=block, enable_fp_fusion=False)
    return out.view(*gate_up.shape[:-1], d)


@triton.jit
def _rope_kernel(x_ptr, cs_ptr, pos_ptr, stride_t, half, HALF: tl.constexpr):
    t = tl.program_id(0)
    base = x_ptr + t * stride_t + tl.program_id(1) * 2 * half
    cols = tl.arange(0, HALF)
    mask = cols < half
    pos = tl.load(pos_ptr + t)
    dtype = x_ptr.dtype.element_ty
    cos = tl.load(cs_ptr + pos * 2 * half + cols, mask=mask, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(cs_ptr + pos * 2 * half + half + cols, mask=mask, other=0.0).to(dtype).to(tl.float32)
    x1 = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half + cols, mask=mask, other=0.0).to(tl.float32)
    # x1 <- x1 cos - x2 sin, x2 <- x2 cos + x1 sin, each product and sum rounded as torch rounds it
    y1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    y2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(base + cols, y1.to(dtype), mask=mask)
    tl.store(base + half + cols, y2.to(dtype), mask=mask)


def rope_(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> None:
    """Rotate ``x`` [T, heads, head_dim] (heads contiguous in a row) in place; ``cos_sin``
    [max_positions, head_dim] float32 holds each frequency's cos then its sin."""
    t, heads, d = x.shape
    if t:
        _rope_kernel[(t, heads)](x, cos_sin, positions, x.stride(0), d // 2, HALF=triton.next_power_of_2(d // 2),
                                 enable_fp_fusion=False)
