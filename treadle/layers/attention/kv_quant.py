"""The quantized KV cache format (``kv_cache_dtype`` int8 / fp8), shared by every backend.

A quantized cache keeps the float cache's shape except for the last axis: each (token, KV
head) row holds its ``head_dim`` quantized values and then its own float32 scale, in the same
slot, so anything that moves a slot or a block (prefix sharing, a tensor-parallel shard of
heads, a block copied to another instance) carries the scale with it::

    cache [num_blocks, block_size, num_kv_heads, head_dim + 4]   dtype int8 or float8_e4m3fn
    row   | q_0 q_1 ... q_{D-1} | scale (4 bytes, float32) |
    value x_d = q_d * scale

int8: symmetric, scale = max_d |x_d| / 127, q_d = round(x_d / scale) (half to even).
fp8 (e4m3fn): scale = max_d |x_d| / 448 (e4m3's largest finite value), q_d = x_d / scale
rounded to e4m3. A per-row scale rather than one per tensor: it needs no calibration pass,
follows each token's own range (keys have outlier heads and tokens), and it makes both
formats one code path; it costs 4 bytes per row (6 % at head_dim 64).
Rows whose values are all zero get scale 0 (and decode to zeros).

The layout needs ``head_dim % 4 == 0`` (the scale is read as a float32 view of the row).
Values are quantized once, where they are written into the cache (``write_quantized``, used
by every backend's write, so all backends hold the same bytes), and dequantized where read.
"""
from __future__ import annotations

import torch

from treadle.config import TreadleError

SCALE_BYTES = 4
# the storage type of each quantized kv_cache_dtype, and the largest value it represents
QUANTIZED_KV = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}


def cache_dtype(kv_cache_dtype: str) -> torch.dtype:
    """The torch dtype a cache is allocated with, from CacheConfig's resolved ``kv_cache_dtype``
    ("int8", "fp8", or the model's float dtype name, e.g. "float32")."""
    if kv_cache_dtype in QUANTIZED_KV:
        return QUANTIZED_KV[kv_cache_dtype][0]
    dtype = getattr(torch, kv_cache_dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TreadleError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of auto, {', '.join(QUANTIZED_KV)}")
    return dtype


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in (torch.int8, torch.float8_e4m3fn)


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements in the last axis of a cache of ``dtype``: head_dim, plus the scale when quantized."""
    if dtype in (torch.int8, torch.float8_e4m3fn):
        if head_dim % 4:
            raise TreadleError(f"a quantized KV cache needs head_dim divisible by 4, not {head_dim}")
        return head_dim + SCALE_BYTES
    return head_dim


def row_bytes(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one (token, KV head) row of K (or V) takes in a cache of ``dtype``."""
    return row_width(head_dim, dtype) * torch.tensor([], dtype=dtype).element_size()


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D] float -> [..., D + 4] packed rows of ``dtype`` (values, then the float32 scale)."""
    qmax = QUANTIZED_KV["int8" if dtype == torch.int8 else "fp8"][1]
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / qmax  # [..., 1]
    scaled = xf / torch.where(scale > 0, scale, torch.ones_like(scale))
    if dtype == torch.int8:
        q = scaled.round_().clamp_(-127, 127).to(torch.int8)
    else:  # |scaled| <= 448 up to rounding; clamp so the cast cannot overflow to NaN
        q = scaled.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=-1).view(dtype)


def dequantize(rows: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., D + 4] packed rows -> [..., D] values in ``out_dtype`` (computed in float32)."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows.view(torch.uint8)[..., d:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :d].float() * scale).to(out_dtype)


def read_cache(rows: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Cache rows (any shape [..., width]) as ``out_dtype`` values: dequantized when packed."""
    return dequantize(rows, out_dtype) if is_quantized(rows) else rows.to(out_dtype)


def write_quantized(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], every row written (no negative slots)
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim + 4] quantized
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [num_tokens] int64, all >= 0
) -> None:
    """Quantize the new K/V rows and scatter them into their slots (the one quantizing write)."""
    width = k_cache.shape[2] * k_cache.shape[3]
    for x, cache in ((k, k_cache), (v, v_cache)):
        packed = quantize(x, cache.dtype).view(torch.uint8).reshape(-1, width)
        cache.view(torch.uint8).view(-1, width).index_copy_(0, slots, packed)
