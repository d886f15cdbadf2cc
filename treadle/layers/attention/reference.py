"""Reference attention backend: plain torch, one sequence at a time, obviously correct.

It is the oracle the fast backends are tested against, and the fallback on any device.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from treadle.layers.attention.backend import AttentionBackend, AttentionSpec, gather_context, write_kv
from treadle.layers.attention.kv_quant import read_cache
from treadle.layers.attention.metadata import AttentionMetadata


def causal_mask(query_len: int, seq_len: int, sliding_window: int | None) -> torch.Tensor:
    """[query_len, seq_len] bool mask: query i (at position seq_len - query_len + i)
    sees key j when j <= its position (and within the sliding window, if any)."""
    q_pos = torch.arange(seq_len - query_len, seq_len).unsqueeze(1)
    k_pos = torch.arange(seq_len).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= (q_pos - k_pos) < sliding_window
    return mask


class ReferenceBackend(AttentionBackend):
    name = "reference"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, spec: AttentionSpec) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        group = spec.num_heads // spec.num_kv_heads
        start = 0
        for i, (q_len, s_len) in enumerate(zip(meta.query_lens, meta.seq_lens)):
            if q_len == 0:
                continue
            keys = read_cache(gather_context(k_cache, meta.block_tables[i], s_len), q.dtype)
            values = read_cache(gather_context(v_cache, meta.block_tables[i], s_len), q.dtype)
            # [H, q_len, D] x [H, s_len, D]; expand KV heads for GQA/MQA
            qi = q[start : start + q_len].transpose(0, 1)
            ki = keys.transpose(0, 1).repeat_interleave(group, dim=0)
            vi = values.transpose(0, 1).repeat_interleave(group, dim=0)
            mask = causal_mask(q_len, s_len, spec.sliding_window).to(q.device)
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=spec.scale)
            out[start : start + q_len] = o.transpose(0, 1)
            start += q_len
        return out
