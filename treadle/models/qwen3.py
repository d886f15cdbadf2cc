"""Qwen3: the Llama block with an RMSNorm over each query and key head before RoPE (no qkv
bias, an explicit head_dim that need not be hidden / heads)."""
from __future__ import annotations

from typing import ClassVar

import torch

from treadle.config import ModelConfig
from treadle.layers.attention import AttentionBackend
from treadle.layers.norm import RMSNorm
from treadle.layers.rotary import RotaryEmbedding
from treadle.models.layout import LLAMA_NORMS, ModelLayout, NormLayout, head_dim, llama_linears
from treadle.models.llama import LlamaAttention, LlamaForCausalLM, MethodFactory

QWEN3_LAYOUT = ModelLayout(
    linears=llama_linears(),
    norms=(LLAMA_NORMS[0], NormLayout("self_attn.q_norm", head_dim), NormLayout("self_attn.k_norm", head_dim),
           LLAMA_NORMS[1]),
)


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, layout: ModelLayout, backend: AttentionBackend, dtype: torch.dtype,
                 method: MethodFactory, prefix: str, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, layout, backend, dtype, method, prefix, rotary)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)  # [head_dim], shared by every head
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, num_heads, D], k [T, num_kv_heads, D] -> each head RMS-normalized (new tensors)."""
        d = q.shape[-1]
        q = self.q_norm(q.reshape(-1, d))[0].view(q.shape)
        k = self.k_norm(k.reshape(-1, d))[0].view(k.shape)
        return q, k


class Qwen3ForCausalLM(LlamaForCausalLM):
    layout: ClassVar[ModelLayout] = QWEN3_LAYOUT
    attention_cls: ClassVar[type[LlamaAttention]] = Qwen3Attention
