"""Triton kernels for paged attention: cache write, chunked prefill, split-KV decode.

This module imports triton at the top; only ``TritonBackend`` imports it, lazily.

Every kernel reads keys of sequence ``s`` at position ``p`` through its block table::

    block = block_tables[s, p // block_size]
    addr  = block * stride_cb + (p % block_size) * stride_cs + kv_head * stride_ch + d

so a key tile of ``BLOCK_N`` positions is a gather, independent of ``block_size``.

Prefill (FlashAttention): one program per (sequence, query head, tile of BLOCK_M new
tokens). Query ``i`` of the chunk sits at position ``ctx_len + i``, where ``ctx_len`` =
seq_len - query_len tokens were cached by earlier steps::

    keys:   | cached context (paged cache)  | new chunk (k, v tensors)   |
            0                           ctx_len                      seq_len
    pass 1: all visible (window aside)      pass 2: key j visible iff j <= i

Decode (FlashDecoding): one program per (sequence, KV head, split); the program scores
all ``group`` query heads that share the KV head against its slice of the context and
stores an unnormalised partial (m, l, acc); a second kernel merges the splits::

    split s covers [lo + s*per_split, lo + (s+1)*per_split),  per_split = ceil(span/S)
    rounded up to whole BLOCK_N tiles (so a short context leaves trailing splits empty)
    M = max_s m_s,   out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s

The number of splits is a compile-time constant and the split bounds are computed on
the device from ``seq_lens``, so a decode step launches the same grid whatever the
lengths are: the path is safe to capture in a CUDA graph.

Quantized caches (``KV_QUANT`` 1: int8, 2: float8 e4m3fn; ``kv_quant``'s packed rows): the
cache pointers are byte-typed, the strides count bytes, and each row's float32 scale sits
right after its ``head_dim`` values; ``scale_ptr`` is a float32 view of the same memory, so
the scale of the row at byte offset ``base`` is ``scale_ptr[(base + head_dim) // 4]``. e4m3
bytes are decoded with integer arithmetic (any GPU, and the interpreter).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    block_size, num_kv_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per new token: copy its [num_kv_heads, head_dim] K and V into the
    slot ``slot_mapping[t]``; a negative slot writes nothing."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    # the scalar test is broadcast by hand: the interpreter mis-types `block & scalar_bool`
    mask = (heads < num_kv_heads) & (dims < head_dim) & (heads * 0 + dims * 0 + slot >= 0)
    safe = tl.maximum(slot, 0)
    dst = (safe // block_size) * stride_cb + (safe % block_size) * stride_cs + heads * stride_ch + dims
    k = tl.load(k_ptr + t * stride_kt + heads * stride_kh + dims, mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + heads * stride_vh + dims, mask=mask, other=0.0)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b accumulated in fp32; full fp32 precision (no TF32) when IEEE."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, IEEE: tl.constexpr):
    """Fold one tile of masked scores s [M, N] and values v [N, D] into the running
    max m_i [M], denominator l_i [M] and numerator acc [M, D]. Rows that have seen
    only masked keys keep m_i = -inf and contribute nothing (no NaN)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return m_new, l_i, acc


@triton.jit
def _fp8_e4m3_to_f32(b):
    """float8 e4m3fn bytes (as int32 0..255) -> float32: (1 + m/8) 2^(e-7), or m 2^-9 when e = 0."""
    e = (b >> 3) & 15
    m = (b & 7).to(tl.float32)
    pow2 = ((e + 120) << 23).to(tl.float32, bitcast=True)  # 2^(e-7), built in the exponent bits
    mag = tl.where(e == 0, m * 0.001953125, (1.0 + m * 0.125) * pow2)
    return tl.where((b & 128) != 0, -mag, mag)


@triton.jit
def _load_kv(cache_ptr, scale_ptr, base, offs_d, row_valid, d_valid, head_dim, KV_QUANT: tl.constexpr):
    """The [N, BLOCK_D] tile of rows at offsets base [N] (rows row_valid, columns d_valid) in
    float32 (a float cache's values exactly; int8 / fp8 rows dequantized, each times its scale).
    One return type for every KV_QUANT: a real compile unifies the branches' return types."""
    raw = tl.load(cache_ptr + base[:, None] + offs_d[None, :], mask=row_valid[:, None] & d_valid[None, :], other=0)
    if KV_QUANT == 0:
        return raw.to(tl.float32)
    else:
        scale = tl.load(scale_ptr + (base + head_dim) // 4, mask=row_valid, other=0.0)
        if KV_QUANT == 1:
            values = raw.to(tl.float32)
        else:
            values = _fp8_e4m3_to_f32(raw.to(tl.int32) & 255)
        return values * scale[:, None]


@triton.jit
def _paged_offsets(block_tables_ptr, row, pos, valid, block_size, stride_cb, stride_cs, kv_head, stride_ch):
    """Cache offset [N] (without the head_dim term) of positions pos [N] of one sequence."""
    block = tl.load(block_tables_ptr + row + pos // block_size, mask=valid, other=0).to(tl.int64)
    return block * stride_cb + (pos % block_size) * stride_cs + kv_head * stride_ch


@triton.jit
def _head_rows(ptr, rows, stride_t, head_offset, offs_d):
    """Pointers [N, BLOCK_D] to one head's values in rows [N] of a [tokens, heads, head_dim] tensor."""
    return ptr + rows[:, None] * stride_t + head_offset + offs_d[None, :]


@triton.jit
def prefill_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_ptr,
    scale, window,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    block_size, head_dim, group,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    """Causal attention of one tile of a sequence's new tokens over its cached context
    (read through the block table) and over the new chunk (read from k, v)."""
    seq, head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_head = head // group
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + seq) - q_len
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # index of the query in the chunk
    offs_d = tl.arange(0, BLOCK_D)
    m_valid, d_valid = offs_m < q_len, offs_d < head_dim
    q_rows = (q_start + offs_m).to(tl.int64)
    qd_mask = m_valid[:, None] & d_valid[None, :]
    q = tl.load(_head_rows(q_ptr, q_rows, stride_qt, head * stride_qh, offs_d), mask=qd_mask, other=0.0)
    q_pos = ctx_len + offs_m
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # pass 1: cached context, skipping keys left of every query's sliding window
    lo = tl.maximum(ctx_len + tile * BLOCK_M - window + 1, 0)
    for start in range(lo, ctx_len, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_valid = k_pos < ctx_len
        base = _paged_offsets(block_tables_ptr, seq * stride_bt, k_pos, k_valid, block_size, stride_cb, stride_cs,
                              kv_head, stride_ch)
        k = _load_kv(k_cache_ptr, k_scale_ptr, base, offs_d, k_valid, d_valid, head_dim, KV_QUANT).to(q.dtype)
        v = _load_kv(v_cache_ptr, v_scale_ptr, base, offs_d, k_valid, d_valid, head_dim, KV_QUANT).to(q.dtype)
        s = _dot(q, tl.trans(k), IEEE) * scale
        visible = k_valid[None, :] & (q_pos[:, None] - k_pos[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, IEEE)
    # pass 2: the new chunk itself, causal
    lo = tl.maximum(tile * BLOCK_M - window + 1, 0)
    hi = tl.minimum(q_len, (tile + 1) * BLOCK_M)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_valid = j < q_len
        kv_mask = j_valid[:, None] & d_valid[None, :]
        j_rows = (q_start + j).to(tl.int64)
        k = tl.load(_head_rows(k_ptr, j_rows, stride_kt, kv_head * stride_kh, offs_d), mask=kv_mask, other=0.0)
        v = tl.load(_head_rows(v_ptr, j_rows, stride_vt, kv_head * stride_vh, offs_d), mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k.to(q.dtype)), IEEE) * scale
        visible = j_valid[None, :] & (j[None, :] <= offs_m[:, None]) & (offs_m[:, None] - j[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v.to(q.dtype), m_i, l_i, acc, IEEE)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(_head_rows(out_ptr, q_rows, stride_ot, head * stride_oh, offs_d), out.to(out_ptr.dtype.element_ty),
             mask=qd_mask)


@triton.jit
def decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
    part_acc_ptr, part_ml_ptr,
    scale, window,
    stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt,
    block_size, head_dim, group, num_heads,
    NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr, KV_QUANT: tl.constexpr,
):
    """Partial attention of one decode token's query heads in KV group ``kv_head``
    over split ``split`` of its context. Writes acc [group, D] and (m, l) per head to
    part_acc [S, H, NUM_SPLITS, D] and part_ml [S, H, NUM_SPLITS, 2]."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(query_start_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = tl.maximum(seq_len - window, 0)
    # whole tiles per split: short contexts use fewer splits instead of ragged tiles
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    s_lo = lo + split * per_split
    s_hi = tl.minimum(seq_len, s_lo + per_split)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_valid = offs_g < group
    d_valid = offs_d < head_dim
    heads = kv_head * group + offs_g
    q = tl.load(
        q_ptr + token.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_valid[:, None] & d_valid[None, :], other=0.0,
    )  # [BLOCK_G, BLOCK_D]
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    row = seq * stride_bt
    for start in range(s_lo, s_hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_valid = k_pos < s_hi
        base = _paged_offsets(block_tables_ptr, row, k_pos, k_valid, block_size, stride_cb, stride_cs, kv_head, stride_ch)
        k = _load_kv(k_cache_ptr, k_scale_ptr, base, offs_d, k_valid, d_valid, head_dim, KV_QUANT).to(q.dtype)
        v = _load_kv(v_cache_ptr, v_scale_ptr, base, offs_d, k_valid, d_valid, head_dim, KV_QUANT).to(q.dtype)
        s = _dot(q, tl.trans(k), IEEE) * scale
        s = tl.where(k_valid[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, IEEE)
    part = (seq * num_heads + heads).to(tl.int64) * NUM_SPLITS + split  # [BLOCK_G]
    tl.store(part_acc_ptr + part[:, None] * head_dim + offs_d[None, :], acc, mask=g_valid[:, None] & d_valid[None, :])
    tl.store(part_ml_ptr + part * 2, m_i, mask=g_valid)
    tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=g_valid)


@triton.jit
def decode_reduce_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, query_start_ptr,
    stride_ot, stride_oh, head_dim, num_heads,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Merge the NUM_SPLITS partials of one (sequence, query head) by log-sum-exp.
    A sequence with nothing to attend to (seq_len 0, e.g. CUDA-graph padding) gets 0."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(query_start_ptr + seq)
    if tl.load(query_start_ptr + seq + 1) == token:  # no new token for this sequence
        return
    token = token.to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_valid = offs_s < NUM_SPLITS
    part = (seq * num_heads + head).to(tl.int64) * NUM_SPLITS + offs_s  # [BLOCK_S]
    m = tl.load(part_ml_ptr + part * 2, mask=s_valid, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=s_valid, other=0.0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * head_dim + offs_d[None, :],
        mask=s_valid[:, None] & (offs_d[None, :] < head_dim), other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp(m - m_max)  # 0 for empty splits
    denom = tl.sum(w * l_s, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < head_dim)
