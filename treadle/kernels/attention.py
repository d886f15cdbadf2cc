"""Decode attention over the paged KV cache with the C kernel (``csrc/paged_attention.c``).

One call per layer and decode step writes the new K/V rows into the cache and returns the
attention of every sequence's one new query over its whole context. The cache is float32 or
quantized (``treadle.layers.attention.kv_quant``'s packed int8 / float8_e4m3fn rows, each
head_dim values and a float32 scale): the kernel quantizes what it writes and dequantizes
what it reads. A bfloat16 cache (a bfloat16 model's) is read the same way, widened to float32
exactly; q/k/v then come in bfloat16 (or float32), are taken as float32, and the output has q's
dtype.
"""
from __future__ import annotations

import torch

from treadle.kernels import native

# csrc/tq.h's kv_format of each cache dtype the kernel reads, and the extra elements of its rows
KV_FORMATS = {torch.float32: (0, 0), torch.int8: (1, 4), torch.float8_e4m3fn: (2, 4), torch.bfloat16: (3, 0)}


def paged_decode(
    q: torch.Tensor,  # [B, num_heads, head_dim] float32 (or bfloat16 with a bfloat16 cache), rows any stride
    k: torch.Tensor,  # [B, num_kv_heads, head_dim] same dtype as q, the new keys
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim (+ 4)] float32 / int8 / fp8 / bf16, contiguous
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [B] int64 contiguous, cache slot of each new row; < 0 = not written
    block_tables: torch.Tensor,  # [B, max_blocks] int32 contiguous
    seq_lens: torch.Tensor,  # [B] int32 contiguous, >= 1, new token included
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor | None:  # [B, num_heads, head_dim] q's dtype
    """Write k/v at ``slots``, then attend (causal, GQA, optional sliding window). Returns
    None when the inputs are not what the kernel handles, so the caller can fall back."""
    b, h, d = q.shape
    f32, row, dtype = torch.float32, (d, 1), q.dtype  # heads contiguous within a row; rows any stride
    kv_format, extra = KV_FORMATS.get(k_cache.dtype, (-1, 0))
    if k_cache.dtype is torch.bfloat16 and q.dtype is k.dtype is v.dtype is torch.bfloat16:
        q, k, v = q.float(), k.float(), v.float()
    if not (
        q.dtype == k.dtype == v.dtype == f32
        and kv_format >= 0
        and k_cache.dtype == v_cache.dtype
        and k_cache.is_cpu
        and q.stride()[1:] == k.stride()[1:] == v.stride()[1:] == row
        and k.shape == v.shape == (b, k_cache.shape[2], d)
        and k_cache.shape == v_cache.shape
        and k_cache.shape[3] == d + extra
        and h % k.shape[1] == 0
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and (sliding_window is None or sliding_window > 0)
        and native.available()
    ):
        return None
    # the step's index tensors (built once per step by the caller): checked, not converted
    assert slots.dtype == torch.int64 and block_tables.dtype == seq_lens.dtype == torch.int32
    assert slots.is_contiguous() and block_tables.is_contiguous() and seq_lens.is_contiguous()
    out = torch.empty(b, h, d, dtype=torch.float32)
    native.kernel("tq_paged_decode")(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0), v.stride(0),
        k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
        b, block_tables.shape[1], k_cache.shape[1], h, k.shape[1], d, sliding_window or 0, scale, kv_format,
        out.data_ptr(),
    )
    return out if dtype is f32 else out.to(dtype)
