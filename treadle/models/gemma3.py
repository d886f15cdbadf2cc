"""Gemma 3 (text): the Llama block with Gemma's differences, declared in its layout and made
here from the shared layers::

    x = embed(ids) * sqrt(hidden)            (in the activations' dtype, as transformers does)
    per layer:  h = post_attention_norm(attention(input_norm(x)))      q/k RMS-normalized per head
                x = x + h
                h = post_feedforward_norm(mlp(pre_feedforward_norm(x)))  GeGLU: gelu_tanh(gate) * up
                x = x + h
    logits = norm(x) @ embed.T                (tied)

Every RMSNorm multiplies by (1 + weight): the model holds the multiplier itself, so a Hugging
Face checkpoint's norms get 1 added on load (a GGUF file holds the multiplier already; its
loader hands it over in Hugging Face's form). Layers alternate between a sliding window
(``cfg.layer_window``) with RoPE base ``rope_local_theta`` and full attention with
``rope_theta``; the softmax scale is ``query_pre_attn_scalar ** -0.5``.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
from torch import nn

from treadle.config import ModelConfig, TreadleError
from treadle.distributed import ParallelContext
from treadle.layers.activation import gelu_tanh_and_mul
from treadle.layers.attention import AttentionBackend, AttentionMetadata, AttentionSpec
from treadle.layers.norm import RMSNorm
from treadle.layers.rotary import RotaryEmbedding
from treadle.models.layout import LLAMA_NORMS, ModelLayout, NormLayout, head_dim, hidden, llama_linears
from treadle.models.llama import KVCache, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, MethodFactory
from treadle.models.qwen3 import Qwen3Attention

GEMMA3_LAYOUT = ModelLayout(
    linears=llama_linears(),
    norms=(LLAMA_NORMS[0], NormLayout("self_attn.q_norm", head_dim), NormLayout("self_attn.k_norm", head_dim),
           LLAMA_NORMS[1], NormLayout("pre_feedforward_layernorm", hidden),
           NormLayout("post_feedforward_layernorm", hidden)),
)


class Gemma3Attention(Qwen3Attention):
    """Qwen3's per-head q/k norms, with this layer's window, RoPE table and softmax scale."""

    def __init__(self, cfg: ModelConfig, layout: ModelLayout, backend: AttentionBackend, dtype: torch.dtype,
                 method: MethodFactory, prefix: str, rotary: RotaryEmbedding, window: int | None) -> None:
        super().__init__(cfg, layout, backend, dtype, method, prefix, rotary)
        scalar = cfg.query_pre_attn_scalar or cfg.head_dim
        self.spec = AttentionSpec(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                  scale=scalar**-0.5, sliding_window=window)


class Gemma3MLP(LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class Gemma3DecoderLayer(LlamaDecoderLayer):
    """Llama's (x, residual) stream, with a norm on the attention's and on the MLP's output
    before each joins the residual. Under tensor parallelism the output norms come after the
    all-reduce (they are not linear), so the layer returns a complete (reduced) output."""

    def __init__(self, attention: LlamaAttention, mlp: nn.Module, cfg: ModelConfig, parallel: ParallelContext) -> None:
        super().__init__(attention, mlp, cfg, parallel)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.attention_part(positions, x, residual, kv_cache, meta)
        h, residual = self.mlp_part(self.parallel.all_reduce(h), residual)
        return self.post_feedforward_layernorm(self.parallel.all_reduce(h))[0], residual

    def mlp_part(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the reduced attention output -> (partial MLP output, residual with attention added)."""
        x = self.post_attention_layernorm(x)[0]
        h, residual = self.pre_feedforward_layernorm(x, residual)
        return self.mlp(h), residual


_NORM_SUFFIX = "norm.weight"  # every RMSNorm weight of a Gemma checkpoint is stored as w, used as 1 + w


class Gemma3ForCausalLM(LlamaForCausalLM):
    layout: ClassVar[ModelLayout] = GEMMA3_LAYOUT

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype = torch.float32,
                 method: MethodFactory | None = None, parallel: ParallelContext | None = None) -> None:
        self.local_rotary: RotaryEmbedding | None = None  # the sliding layers' table, made with the first
        super().__init__(cfg, backend, dtype, method, parallel)
        # sqrt(hidden) rounded to the activations' dtype, as transformers scales the embedding
        self.embed_scale = float(torch.tensor(cfg.hidden_size**0.5, dtype=dtype))

    def make_layer(self, cfg: ModelConfig, layer: int, backend: AttentionBackend, dtype: torch.dtype,
                   method: MethodFactory, rotary: RotaryEmbedding) -> nn.Module:
        window = cfg.layer_window(layer)
        if window is not None:  # a sliding layer: RoPE with the local base
            if self.local_rotary is None:
                self.local_rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                                    cfg.rope_local_theta or cfg.rope_theta, None)
            rotary = self.local_rotary
        p = f"{self.layout.layer_prefix}.{layer}"
        attn = Gemma3Attention(cfg, self.layout, backend, dtype, method, p, rotary, window)
        return Gemma3DecoderLayer(attn, Gemma3MLP(cfg, self.layout, dtype, method, p), cfg, self.parallel)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.embed_scale

    def forward_overlapped(self, input_ids: torch.Tensor, micro: list[tuple[torch.Tensor, AttentionMetadata]],
                           kv_caches: list[KVCache]) -> torch.Tensor:
        raise TreadleError("Gemma 3 does not run with comm_overlap (its output norms follow each all-reduce)")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Hugging Face-named tensors; each norm's stored w becomes the multiplier 1 + w."""
        return super().load_weights(_norms_plus_one(weights))


def _norms_plus_one(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if name.endswith(_NORM_SUFFIX):
            if not isinstance(tensor, torch.Tensor):  # a rank's unread slice (norms are whole on every rank)
                tensor = tensor.read()
            tensor = tensor.float() + 1.0  # transformers: (1.0 + weight.float())
        yield name, tensor
