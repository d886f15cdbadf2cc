"""CPU attention backend: FlashAttention prefill (torch SDPA's flash CPU kernel) and
FlashDecoding split-KV decode over the paged cache, batched across sequences.

A step's flat batch is split once into a *plan* (``plan``, called by the runner once per
step and stored in the metadata, read by every layer): decode sequences (one new token)
and prefill sequences (a chunk of new tokens, possibly after cached context).

Decode (FlashDecoding). Each decode sequence's block table is padded to
``num_splits * blocks_per_split`` blocks and gathered (``index_select``); the context is
cut into ``num_splits`` chunks, each attended by torch's flash CPU kernel, which also
returns the chunk's log-sum-exp; chunks are then merged by those::

    block table  [7, 2, 9, 4, 0(pad), 0(pad)]   blocks_per_split = 2, block_size = 16
    chunks       |  7  2  |  9  4  | pad pad |   -> 3 chunks of 32 keys
    chunk s:     o_s = softmax(q.K_s) V_s,   lse_s = log sum exp(q.K_s)
    merge:       out = sum_s softmax_s(lse_s) o_s

GQA: the G query heads sharing a KV head become G query *rows* against that head's
keys, so K/V are never repeated. All chunks of all sequences and KV heads go to the
kernel as one batch, so a single long sequence still spreads over every core. Keys
past ``seq_len`` (or outside a sliding window) get a huge finite negative bias, so a
chunk with no valid key has lse ~ -1e38 and weight 0 in the merge (no NaN).

Decode rows with float32 q/k/v and cache go to the C kernel instead
(``treadle.kernels.attention.paged_decode``: the same FlashDecoding split, reading keys
through the block table without a gather; on all-decode steps it also writes the new K/V,
in mixed steps those are written with the prompt chunks' first); the torch path above
serves other dtypes and machines without a C compiler.

Short queries are decode rows too: a sequence with at most ``DECODE_ROWS_MAX`` new tokens (a
speculative verify: the last token and K drafts) becomes one decode row per token, row j
attending to the keys before position ``seq_len - query_len + j`` and itself. Every row's
K/V is written before any row attends (both kernels), so this is exact causal attention,
and a verify-only step stays an all-decode step (the one-call C layer).

Prefill (and chunked prefill) runs SDPA per sequence with 4-D inputs (the flash CPU
kernel; 3-D inputs fall back to the math kernel), causal without cached context,
otherwise with an explicit [q_len, seq_len] mask over the gathered context.

A quantized cache (int8 / fp8 rows with a scale each, ``kv_quant``): torch writes quantize
through ``kv_quant.write_quantized``; the torch reads dequantize what they gather; a prompt
chunk without cached context attends to its own keys rounded through the quantizer (what the
cache now holds). The C kernel reads and writes the packed rows itself.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from treadle.kernels import native
from treadle.kernels.attention import paged_decode
from treadle.layers.attention.backend import AttentionBackend, AttentionSpec
from treadle.layers.attention.kv_quant import dequantize, is_quantized, quantize, read_cache, write_quantized
from treadle.layers.attention.metadata import AttentionMetadata, DecodeKernelArgs, StepPlan

DECODE_ROWS_MAX = 16  # queries this short run as decode rows (speculative verifies)
_SPLIT_MIN_TOKENS = 256  # decode contexts up to this long are not split
_WORK_PER_THREAD = 4  # split so that (seqs x KV heads x chunks) >= this many per thread


@dataclass
class _PrefillSeq:
    seq: int  # index of the sequence in the batch
    start: int  # first flat token of its query
    query_len: int
    seq_len: int


@dataclass
class _DecodePlan:
    """Layer-independent part of a decode plan."""

    token_index: torch.Tensor  # [B] int64, flat index of each decode token
    seq_lens: list[int]  # [B]
    block_tables: torch.Tensor  # [B, max_blocks] int32 (metadata's rows, padded with 0)
    max_blocks: int
    all_tokens: bool  # every token of the step is a decode token, in order
    # index tensors for the C kernel, on CPU steps (all-decode: the real slots; mixed: -1, already written)
    kernel_args: DecodeKernelArgs | None = None
    layouts: dict[tuple[int, int | None, torch.dtype], _SplitLayout] = field(default_factory=dict)


@dataclass
class _SplitLayout:
    """How one attention shape splits the decode contexts into chunks."""

    num_splits: int
    split_len: int  # keys per chunk (a whole number of blocks)
    flat_table: torch.Tensor  # [B * num_splits * blocks_per_split] int64, padded with block 0
    mask: torch.Tensor  # [B * num_splits, 1, 1, split_len] additive: 0 or a huge negative


def _split_layout(
    plan: _DecodePlan, block_size: int, num_kv_heads: int, window: int | None, dtype: torch.dtype
) -> _SplitLayout:
    b, max_blocks = len(plan.seq_lens), plan.max_blocks
    splits = 1
    if max_blocks * block_size > _SPLIT_MIN_TOKENS:  # short contexts: one chunk, least overhead
        splits = min(max_blocks, math.ceil(_WORK_PER_THREAD * torch.get_num_threads() / (b * num_kv_heads)))
    per_split = -(-max_blocks // splits)
    splits = -(-max_blocks // per_split)
    padded = splits * per_split
    table = plan.block_tables[:, :padded].long()
    if table.shape[1] < padded:
        table = F.pad(table, (0, padded - table.shape[1]))
    split_len = per_split * block_size
    key_pos = torch.arange(padded * block_size).view(1, splits, split_len)
    lens = torch.tensor(plan.seq_lens).view(-1, 1, 1)
    valid = key_pos < lens  # [B, S, split_len]
    if window is not None:
        valid &= key_pos > lens - 1 - window
    # finite, not -inf: a chunk with no valid key then gets a logsumexp ~ -huge, weight 0
    mask = torch.zeros(valid.shape, dtype=dtype).masked_fill_(~valid, torch.finfo(dtype).min / 2)
    device = plan.block_tables.device
    return _SplitLayout(
        num_splits=splits,
        split_len=split_len,
        flat_table=table.reshape(-1).to(device),
        mask=mask.view(b * splits, 1, 1, split_len).to(device),
    )


@dataclass
class _StepPlan(StepPlan):
    decode: _DecodePlan | None
    prefill: list[_PrefillSeq]
    write_slots: torch.Tensor  # [num_written] int64 slots (skipped ones removed)
    write_rows: torch.Tensor | None  # [num_written] int64 rows of k/v, None = all rows
    rows_only: bool = False  # prompt chunks became decode rows too (build_plan's rows_max None)
    split: _StepPlan | None = None  # for tensors the C kernel refuses: prompts as prefill sequences

    @property
    def decode_kernel_args(self) -> DecodeKernelArgs | None:
        dec = self.decode
        return dec.kernel_args if dec is not None and dec.all_tokens else None


def build_plan(meta: AttentionMetadata, rows_max: int | None = None) -> _StepPlan:
    """The step's split into decode rows (queries of at most ``rows_max`` tokens, one row per
    token) and prefill sequences. ``None``: every token is a row where the C kernel can take
    them (CPU), so a token's attention is computed alike however its prompt was cut."""
    if meta.max_query_len == 1 and meta.num_tokens == meta.num_seqs:  # one token each: rows are sequences
        return _plan_decode_only(meta)
    rows_only = rows_max is None and meta.block_tables.is_cpu and native.available()
    if rows_max is None:
        rows_max = meta.max_query_len if rows_only else DECODE_ROWS_MAX
    row_seqs: list[int] = []  # per decode row: its sequence
    row_index: list[int] = []  # its flat token
    lens: list[int] = []  # its context length, itself included
    prefill: list[_PrefillSeq] = []
    start = 0
    for i, (q_len, s_len) in enumerate(zip(meta.query_lens, meta.seq_lens, strict=True)):
        if 1 <= q_len <= rows_max:
            row_seqs += [i] * q_len
            row_index += range(start, start + q_len)
            lens += range(s_len - q_len + 1, s_len + 1)
        elif q_len > 1:
            prefill.append(_PrefillSeq(seq=i, start=start, query_len=q_len, seq_len=s_len))
        start += q_len
    decode = None
    if row_seqs:
        device = meta.block_tables.device
        tables = meta.block_tables[_tensor(row_seqs, np.int64, device)]
        all_tokens = len(row_seqs) == meta.num_tokens
        decode = _decode_plan(meta, _tensor(row_index, np.int64, device), tables, lens, all_tokens,
                              _tensor(lens, np.int32, torch.device("cpu")))
    plan = _finish_plan(meta, decode, prefill)
    plan.rows_only = rows_only
    return plan


def _plan_decode_only(meta: AttentionMetadata) -> _StepPlan:
    """build_plan for a step of one new token per sequence (no per-row index lists: row i is
    sequence i and flat token i, its context length the sequence's)."""
    lens = meta.seq_lens
    token_index = torch.arange(len(lens), device=meta.block_tables.device)
    decode = _decode_plan(meta, token_index, meta.block_tables, lens, True, meta.seq_lens_tensor.cpu())
    return _finish_plan(meta, decode, [])


def _tensor(values: list[int], dtype: type, device: torch.device) -> torch.Tensor:
    """A small list as a tensor through numpy (torch.tensor(list) is ~10 us a call here)."""
    return torch.from_numpy(np.array(values, dtype=dtype)).to(device)


def _decode_plan(meta: AttentionMetadata, token_index: torch.Tensor, tables: torch.Tensor, lens: list[int],
                 all_tokens: bool, lens_tensor: torch.Tensor) -> _DecodePlan:
    """The decode rows' plan; on CPU steps with the native kernels, their kernel arguments
    (all-decode: the real slots, which the kernel writes; mixed: -1, _write_kv writes first)."""
    decode = _DecodePlan(token_index=token_index, seq_lens=lens, block_tables=tables,
                         max_blocks=-(-max(lens) // meta.block_size), all_tokens=all_tokens)
    if tables.is_cpu and tables.shape[1] >= decode.max_blocks and native.available():
        slots = meta.slot_mapping.to(torch.int64).contiguous() if all_tokens else torch.full(
            (len(lens),), -1, dtype=torch.int64)
        decode.kernel_args = DecodeKernelArgs(slots, tables.to(torch.int32).contiguous(), lens_tensor)
    return decode


def _finish_plan(meta: AttentionMetadata, decode: _DecodePlan | None, prefill: list[_PrefillSeq]) -> _StepPlan:
    slots, rows = meta.slot_mapping, None
    skipped = slots.numpy().min(initial=0) < 0 if slots.is_cpu else bool((slots < 0).any())
    if skipped:
        rows = torch.nonzero(slots >= 0).flatten()
        slots = slots[rows]
    return _StepPlan(decode=decode, prefill=prefill, write_slots=slots, write_rows=rows)


def flash_decode(
    q: torch.Tensor,  # [B, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    plan: _DecodePlan,
    spec: AttentionSpec,
) -> torch.Tensor:  # [B, num_heads, head_dim]
    b, h_kv, d = q.shape[0], spec.num_kv_heads, spec.head_dim
    group = spec.num_heads // h_kv
    key = (h_kv, spec.sliding_window, q.dtype)
    lay = plan.layouts.get(key)
    if lay is None:
        lay = plan.layouts[key] = _split_layout(plan, k_cache.shape[1], h_kv, spec.sliding_window, q.dtype)
    s, n, width = lay.num_splits, lay.split_len, k_cache.shape[3]
    # gathered chunks [B*S, L, Hkv, D], seen as [B*S, Hkv, L, D] (strided, no copy)
    keys = read_cache(k_cache.index_select(0, lay.flat_table).view(b * s, n, h_kv, width), q.dtype).transpose(1, 2)
    values = read_cache(v_cache.index_select(0, lay.flat_table).view(b * s, n, h_kv, width), q.dtype).transpose(1, 2)
    # GQA: the G query heads of a KV head become G "query rows" against the same keys
    qg = q.view(b, 1, h_kv, group, d)
    if s > 1:
        qg = qg.expand(b, s, h_kv, group, d)
    qg = qg.reshape(b * s, h_kv, group, d)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qg, keys, values, attn_mask=lay.mask, scale=spec.scale
    )  # out [B*S, Hkv, G, D], lse [B*S, Hkv, G]
    if s == 1:
        return out.view(b, spec.num_heads, d)
    weight = torch.softmax(lse.view(b, s, h_kv, group, 1).float(), dim=1)  # log-sum-exp merge
    merged = (out.view(b, s, h_kv, group, d).float() * weight).sum(1)  # [B, Hkv, G, D]
    return merged.view(b, spec.num_heads, d).to(q.dtype)


def flash_prefill(
    q: torch.Tensor,  # [q_len, num_heads, head_dim]
    k: torch.Tensor,  # [q_len, num_kv_heads, head_dim], the new keys
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks]
    seq_len: int,
    spec: AttentionSpec,
) -> torch.Tensor:  # [q_len, num_heads, head_dim]
    q_len = q.shape[0]
    context = seq_len - q_len
    if context > 0:  # earlier chunks live only in the cache
        k = read_cache(_gather(k_cache, block_table, seq_len), q.dtype)
        v = read_cache(_gather(v_cache, block_table, seq_len), q.dtype)
    elif is_quantized(k_cache):  # read back what the cache holds, as the reference does
        k, v = dequantize(quantize(k, k_cache.dtype), q.dtype), dequantize(quantize(v, v_cache.dtype), q.dtype)
    elif k_cache.dtype != q.dtype:
        k, v = k.to(k_cache.dtype).to(q.dtype), v.to(v_cache.dtype).to(q.dtype)
    # [1, H, len, D]: the flash CPU kernel needs 4-D inputs (3-D falls back to the math path);
    # bfloat16 runs in float32 (torch's bfloat16 flash kernel is ~25x slower without AVX-512 BF16)
    work = torch.float32 if q.dtype is torch.bfloat16 else q.dtype
    qt, kt, vt = (x.to(work).transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    gqa = spec.num_heads != spec.num_kv_heads
    if context == 0 and spec.sliding_window is None:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=spec.scale, enable_gqa=gqa)
    else:
        q_pos = torch.arange(context, seq_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
        mask = k_pos <= q_pos  # [q_len, seq_len]
        if spec.sliding_window is not None:
            mask &= (q_pos - k_pos) < spec.sliding_window
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=spec.scale, enable_gqa=gqa)
    return o[0].transpose(0, 1).to(q.dtype)


def _write_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    plan: _StepPlan,
) -> None:
    if plan.write_rows is not None:
        k, v = k.index_select(0, plan.write_rows), v.index_select(0, plan.write_rows)
    if is_quantized(k_cache):
        write_quantized(k, v, k_cache, v_cache, plan.write_slots)
        return
    # 2-D views: index_copy_ on 3-D rows is ~100x slower on CPU
    width = k_cache.shape[2] * k_cache.shape[3]
    k_cache.view(-1, width).index_copy_(0, plan.write_slots, k.reshape(-1, width).to(k_cache.dtype))
    v_cache.view(-1, width).index_copy_(0, plan.write_slots, v.reshape(-1, width).to(v_cache.dtype))


def _gather(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, width]
    block_table: torch.Tensor,  # [max_blocks]
    seq_len: int,
) -> torch.Tensor:  # [seq_len, num_kv_heads, width] as stored
    n_blocks = -(-seq_len // cache.shape[1])
    blocks = cache.index_select(0, block_table[:n_blocks].long())
    return blocks.view(-1, *cache.shape[2:])[:seq_len]


class CPUBackend(AttentionBackend):
    """Same contract as ReferenceBackend; fast on CPU. Stateless: the step's split into
    decode and prefill rows comes from ``plan`` through ``meta.plan``."""

    name = "cpu"

    def plan(self, meta: AttentionMetadata) -> _StepPlan:
        return build_plan(meta)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, spec: AttentionSpec) -> torch.Tensor:
        plan = meta.plan if isinstance(meta.plan, _StepPlan) else build_plan(meta)
        dec = plan.decode
        if dec is not None and dec.all_tokens and dec.kernel_args is not None:  # all-decode step: the C kernel
            out = paged_decode(q, k, v, k_cache, v_cache, *dec.kernel_args, spec.scale, spec.sliding_window)
            if out is not None:  # also wrote k/v into the cache
                return out
        if plan.rows_only:  # tensors the kernel does not take: prompt chunks go to SDPA
            if plan.split is None:
                plan.split = build_plan(meta, DECODE_ROWS_MAX)
            plan = plan.split
            dec = plan.decode
        _write_kv(k, v, k_cache, v_cache, plan)
        if dec is not None and dec.all_tokens:
            return flash_decode(q, k_cache, v_cache, dec, spec).to(q.dtype)
        out = torch.empty_like(q)
        if dec is not None:  # decodes fused with prompt chunks (SplitFuse): their rows, gathered
            qd, decoded = q[dec.token_index], None
            if dec.kernel_args is not None:  # slots of -1: the rows are already in the cache
                kd, vd = k[dec.token_index], v[dec.token_index]
                decoded = paged_decode(qd, kd, vd, k_cache, v_cache, *dec.kernel_args, spec.scale, spec.sliding_window)
            out[dec.token_index] = decoded if decoded is not None else flash_decode(qd, k_cache, v_cache, dec, spec).to(q.dtype)
        for p in plan.prefill:
            rows = slice(p.start, p.start + p.query_len)
            out[rows] = flash_prefill(
                q[rows], k[rows], v[rows], k_cache, v_cache, meta.block_tables[p.seq], p.seq_len, spec
            )
        return out
