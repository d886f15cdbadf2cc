"""The attention-backend interface every implementation (reference, CPU, Triton) follows."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from treadle.layers.attention.kv_quant import is_quantized, write_quantized
from treadle.layers.attention.metadata import AttentionMetadata, StepPlan


@dataclass(frozen=True)
class AttentionSpec:
    """Per-layer constants an attention backend needs."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None  # attend to keys with q_pos - k_pos < window


class AttentionBackend(ABC):
    """Attention over the paged KV cache. Per step, the runner builds the metadata, calls
    ``plan`` once and stores the result in ``meta.plan``, then runs the model, whose
    attention layers call ``forward`` once each with that same metadata."""

    name: str = "abstract"

    def plan(self, meta: AttentionMetadata) -> StepPlan | None:
        """The layer-independent work of a step (splitting decode and prefill rows, index
        tensors for kernels), done once before any layer runs; the runner stores it in
        ``meta.plan``. Must not write the KV cache. Default: nothing to plan (None).
        ``forward`` must also accept metadata whose ``plan`` is None (a caller that did not
        plan): it then works the plan out itself, per call."""
        return None

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, width]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, width]
        meta: AttentionMetadata,
        spec: AttentionSpec,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write the new K/V into the cache at ``meta.slot_mapping`` (slots < 0 are
        skipped), then return causal attention of every new query over its
        sequence's whole context (cached tokens plus the new ones).

        The cache is float (width = head_dim) or quantized (int8 / float8_e4m3fn rows of
        head_dim values and a scale, ``kv_quant``): then the new rows are quantized as they
        are written, and attention reads every key and value, the new ones included, as the
        cache holds them (dequantized), so the result does not depend on which tokens
        arrived in this step."""


def write_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> None:
    """Scatter new keys/values into their physical slots (quantizing them for a quantized cache)."""
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    if is_quantized(k_cache):
        write_quantized(k, v, k_cache, v_cache, slot_mapping)
        return
    flat_k.index_copy_(0, slot_mapping, k.to(flat_k.dtype))
    flat_v.index_copy_(0, slot_mapping, v.to(flat_v.dtype))


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, width]
    block_table: torch.Tensor,  # [max_blocks]
    seq_len: int,
) -> torch.Tensor:  # [seq_len, num_kv_heads, width]
    """Read one sequence's first ``seq_len`` cached rows (as stored) through its block table."""
    block_size = cache.shape[1]
    n_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:n_blocks].long()]  # [n_blocks, block_size, H, D]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]
