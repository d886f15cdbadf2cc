"""The Llama family (Llama, Mistral, Qwen2, SmolLM): one decoder, configured.

Forward takes flat token ids and positions of a whole batch, the per-layer paged
KV cache and the step's attention metadata, all as explicit arguments.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from treadle.config import ModelConfig
from treadle.kernels.layer import DecodeStep, layer_qtypes
from treadle.layers.activation import silu_and_mul
from treadle.layers.attention import AttentionBackend, AttentionMetadata, AttentionSpec
from treadle.layers.linear import Linear, LinearMethod
from treadle.layers.norm import RMSNorm
from treadle.layers.rotary import RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, num_kv_heads, head_dim]
MethodFactory = Callable[[str], LinearMethod | None]


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        method: MethodFactory,
        prefix: str,
        rotary: RotaryEmbedding,
    ) -> None:
        super().__init__()
        d = cfg.head_dim
        self.spec = AttentionSpec(
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=d,
            scale=d**-0.5,
            sliding_window=cfg.sliding_window,
        )
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.qkv_proj = Linear(
            cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size], cfg.qkv_bias, dtype,
            method(f"{prefix}.qkv_proj"),
        )
        self.o_proj = Linear(self.q_size, [cfg.hidden_size], False, dtype, method(f"{prefix}.o_proj"))
        self.rotary = rotary  # one table shared by every layer
        self.backend = backend

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        spec = self.spec
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, spec.num_heads, spec.head_dim)
        k = k.view(-1, spec.num_kv_heads, spec.head_dim)
        v = v.view(-1, spec.num_kv_heads, spec.head_dim)
        q, k = self.rotary(positions, q, k)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, spec)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, method: MethodFactory, prefix: str) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, [inter, inter], False, dtype, method(f"{prefix}.gate_up_proj"))
        self.down_proj = Linear(inter, [cfg.hidden_size], False, dtype, method(f"{prefix}.down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        method: MethodFactory,
        prefix: str,
        rotary: RotaryEmbedding,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, backend, dtype, method, f"{prefix}.self_attn", rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, dtype, method, f"{prefix}.mlp")

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


# Hugging Face checkpoint name -> (our fused parameter name, shard index)
_STACKED = (
    (".q_proj.", ".qkv_proj.", 0),
    (".k_proj.", ".qkv_proj.", 1),
    (".v_proj.", ".qkv_proj.", 2),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype = torch.float32,
        method: MethodFactory | None = None,
    ) -> None:
        super().__init__()
        method = method or (lambda name: None)
        self.config = cfg
        self.dtype = dtype
        self.backend = backend
        self._one_call_layers: list | bool | None = None  # per-layer block types for the C layer, or False
        # [vocab, hidden]: looked up by ids, and the lm_head too when tied
        self.embed_tokens = Linear(cfg.hidden_size, [cfg.vocab_size], False, dtype, method("model.embed_tokens"))
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, backend, dtype, method, f"model.layers.{i}", rotary) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm.weight.data = self.norm.weight.data.to(dtype)
        for layer in self.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.data = norm.weight.data.to(dtype)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, [cfg.vocab_size], False, dtype, method("lm_head"))

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCache],  # one per layer
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        x = self.embed_tokens.method.embedding(self.embed_tokens, input_ids, self.dtype)
        step = self._one_call_decode(positions, kv_caches, meta)
        if step is not None:  # all-decode CPU step on GGUF blocks: one C call per layer
            residual = torch.empty_like(x)
            for i, (layer, qtypes, cache) in enumerate(zip(self.layers, self._one_call_layers, kv_caches)):
                step.run(layer, qtypes, i == 0, x, residual, cache)
        else:
            residual = None
            for layer, cache in zip(self.layers, kv_caches):
                x, residual = layer(positions, x, residual, cache, meta)
        x, _ = self.norm(x, residual)
        return x

    def _one_call_decode(self, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata) -> DecodeStep | None:
        """The per-step state for ``treadle.kernels.layer`` when this model and step qualify."""
        if self._one_call_layers is None:  # decided once, after the weights are loaded
            qtypes = [layer_qtypes(layer) for layer in self.layers]
            self._one_call_layers = qtypes if all(q is not None for q in qtypes) else False
        decode_args = getattr(self.backend, "decode_kernel_args", None)
        if not self._one_call_layers or decode_args is None:
            return None
        kernel_args = decode_args(meta)
        k_cache = kv_caches[0][0]
        if kernel_args is None or k_cache.dtype != torch.float32 or not k_cache.is_contiguous():
            return None
        cfg = self.config
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return DecodeStep(kernel_args, meta.block_size, positions, cfg.hidden_size, q_size + 2 * kv_size, q_size,
                          cfg.intermediate_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab] float32
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load Hugging Face-named tensors; returns the names of parameters filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name:
                continue
            if hf_name == "lm_head.weight" and self.lm_head is None:
                continue
            name, shard = hf_name.removeprefix("model."), None
            for old, new, idx in _STACKED:
                if old in name:
                    name, shard = name.replace(old, new), idx
                    break
            if name not in params:
                raise KeyError(f"unexpected tensor {hf_name!r} in checkpoint")
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            if loader is not None:
                loader(param, tensor, shard)
            else:
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(f"{hf_name}: expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}")
                param.data.copy_(tensor)
            loaded.add(name)
        return loaded

    def process_weights_after_loading(self) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.method.process_weights_after_loading(module)
