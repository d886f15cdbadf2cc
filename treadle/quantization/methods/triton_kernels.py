"""Triton kernels for quantized linear layers on a GPU: W8A8 (int8 x int8 -> int32) and W4A16
(int4 weights dequantized inside the GEMM loop).

This module imports triton at the top; only ``treadle.quantization.methods.gpu`` imports it, lazily.
Under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (the tests' oracle runs).

W8A8, two kernels (the rule of ``treadle/quantization/methods/w8a8.py``, operation for operation)::

    w8a8_quantize_kernel   one program per token row m:
                           xs[m] = max|x[m, :]| / 127.5 (FLT_EPSILON when 0)
                           xq[m, k] = round_half_even(clamp(x[m, k] / xs[m], -128, 127))
    w8a8_matmul_kernel     one program per [BLOCK_M, BLOCK_N] tile of y:
                           acc = sum_k xq[m, k] * w[n, k]        tl.dot int8 -> int32, exact
                           y = (float(acc) * xs[m]) * ws[n] (+ bias[n])

Divisions are correctly rounded (``div_rn``; Triton's ``/`` is an approximate division on
the GPU), rounding is done by hand (floor + tie test) and both kernels are launched without
fused multiply-adds, so the int8 values, the scales and the epilogue are the bits the CPU
kernel and the torch reference produce.

W4A16 (``w4a16_matmul_kernel``), weights packed two per byte along the inputs::

    packed[k // 2, n] = q[n, k] | q[n, k + 1] << 4        (k even; q in 0..15)
    w[n, k] = q[n, k] * scale[g, n] + mins[g, n],   g = group[shard[n], k]
    y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n])         float32 accumulation

``group`` [S, K] is any map of inputs to groups (k // G, per channel: all 0, or GPTQ's act-order
``g_idx``), one row per shard of a fused layer whose shards differ (``shard`` [N] says which
row each output column uses), so no activation permutation is needed: each K tile gathers its rows of
``scale``/``mins`` ([groups, N], contiguous along N). Contiguous groups of G inputs (G a
multiple of the K tile: 32/64/128, or per channel) take the ``UNIFORM`` path instead, one
row of scale/mins per K tile.
"""
from __future__ import annotations

import triton
import triton.language as tl

FLT_EPSILON = tl.constexpr(1.1920928955078125e-07)


@triton.jit
def _round_half_even(v):
    """round-half-to-even of float32 ``v`` (|v| small), exact: the fraction v - floor(v) is
    exactly representable."""
    r = tl.floor(v)
    f = v - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    up = (f > 0.5) | ((f == 0.5) & odd)
    return tl.where(up, r + 1.0, r)


@triton.jit
def w8a8_quantize_kernel(x_ptr, xq_ptr, xs_ptr, K, stride_x, BLOCK_K: tl.constexpr):
    """One program per row: its per-token scale and int8 values (the rule above)."""
    m = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + m * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    s = tl.math.div_rn(tl.max(amax, axis=0), 127.5)
    s = tl.where(s == 0.0, FLT_EPSILON, s)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + offs < K
        x = tl.load(x_ptr + m * stride_x + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -128.0), 127.0)
        tl.store(xq_ptr + m * K + k0 + offs, _round_half_even(v).to(tl.int8), mask=mask)
    tl.store(xs_ptr + m, s)


@triton.jit
def w8a8_matmul_kernel(
    xq_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, y_ptr, M, N, K,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y [M, N] float32 = the W8A8 product of xq [M, K] int8 and w [N, K] int8 (both contiguous)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(xq_ptr + rm[:, None].to(tl.int64) * K + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0)
        b = tl.load(w_ptr + rn[None, :].to(tl.int64) * K + kk[:, None],
                    mask=(rn[None, :] < N) & (kk[:, None] < K), other=0)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(a, b, out_dtype=tl.int32)
    xs = tl.load(xs_ptr + rm, mask=rm < M, other=0.0)
    ws = tl.load(ws_ptr + rn, mask=rn < N, other=0.0)
    y = acc.to(tl.float32) * xs[:, None]
    y = y * ws[None, :]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + rn, mask=rn < N, other=0.0)[None, :]
    tl.store(y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def w4a16_matmul_kernel(
    x_ptr, packed_ptr, group_ptr, shard_ptr, scale_ptr, mins_ptr, bias_ptr, y_ptr, M, N, K, stride_x, group_size,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, UNIFORM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y [M, N] (y's dtype) = x [M, K] (rows ``stride_x`` apart) times the int4 weight above.
    ``UNIFORM``: group[k] is k // group_size with group_size a multiple of BLOCK_K, so a K tile
    reads one row of scale/mins; otherwise each input's group is gathered."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    shard = tl.load(shard_ptr + rn, mask=rn < N, other=0).to(tl.int64)  # the group row of each column
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        kmask = kk < K
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_x + kk[None, :],
                    mask=(rm[:, None] < M) & kmask[None, :], other=0.0)
        wmask = kmask[:, None] & (rn[None, :] < N)
        byte = tl.load(packed_ptr + (kk[:, None] // 2).to(tl.int64) * N + rn[None, :], mask=wmask, other=0)
        q = ((byte.to(tl.int32) >> ((kk[:, None] % 2) * 4)) & 0xF).to(tl.float32)  # [BLOCK_K, BLOCK_N]
        if UNIFORM:
            row = (k0 // group_size).to(tl.int64) * N + rn
            scale = tl.load(scale_ptr + row, mask=rn < N, other=0.0)
            w = q * scale[None, :] + tl.load(mins_ptr + row, mask=rn < N, other=0.0)[None, :]
        else:
            g = tl.load(group_ptr + shard[None, :] * K + kk[:, None], mask=wmask, other=0).to(tl.int64)
            sm = g * N + rn[None, :]
            w = q * tl.load(scale_ptr + sm, mask=wmask, other=0.0) + tl.load(mins_ptr + sm, mask=wmask, other=0.0)
        if IEEE:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))
