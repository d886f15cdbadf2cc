"""Draft heads on the target's hidden states (the file format: ``head_format.py``).

"Hidden state" here is what the target's forward returns: the last layer's output after the
final norm, the lm_head's input (h_t at position t predicts token t+1). Both heads end in the
target's lm_head, so their drafts live in the target's vocabulary.

Medusa: K residual heads on h_t; head k (k = 0 .. K-1) predicts token t+k+2 (the target's own
lm_head is "head -1", predicting t+1):   logits_k = lm_head(h_t + SiLU(W_k h_t + b_k))

EAGLE: one Llama decoder layer over fc([embed(x_{t+1}); h_t]) at position t; its output stream
goes through the target's final norm, giving a feature g_t that stands in for h_{t+1}:

    index t:      (h_t, x_{t+1}) --fc--> layer (own paged KV) --target norm--> g_t ~ h_{t+1}
    draft:        d = argmax lm_head(g_t)            (token t+2)
    chain:        (g_t, d) at index t+1 -> g_{t+1} -> the next draft, and so on

Training (``head_training.py``) runs ``EagleTrainLayer``: the same arithmetic in plain torch
over [batch, time] (causal SDPA, autograd); inference runs ``EagleLayer``: Treadle's own
``LlamaDecoderLayer`` on the paged cache, loaded from the same tensors. A test holds the two
to the same outputs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from treadle.config import ModelConfig
from treadle.distributed import ParallelContext
from treadle.distributed.vocab import vocab_embedding
from treadle.layers.attention import AttentionMetadata
from treadle.layers.linear import Linear
from treadle.layers.norm import rms_norm_plain
from treadle.layers.rotary import RotaryEmbedding
from treadle.models.llama import (
    LLAMA_LAYOUT,
    KVCache,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
)
from treadle.spec_decode.head_format import EagleLayerShape, eagle_layer_config


class MedusaHeads(nn.Module):
    """K residual blocks; W starts at zero, so an untrained head k repeats the lm_head's token."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        linears = [nn.Linear(hidden_size, hidden_size) for _ in range(num_heads)]
        for lin in linears:
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)
        self.heads = nn.ModuleList(linears)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., H] -> [K, ..., H]
        return torch.stack([hidden + F.silu(lin(hidden)) for lin in self.heads])


class _Norm(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))


class _Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)


class _MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)


class _PlainDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = _Norm(cfg.hidden_size), _Norm(cfg.hidden_size)
        self.self_attn, self.mlp = _Attention(cfg), _MLP(cfg)


class EagleTrainLayer(nn.Module):
    """The EAGLE layer in plain torch over [B, T] sequences starting at position 0; its
    ``state_dict`` names are the file's."""

    def __init__(self, target: ModelConfig, shape: EagleLayerShape) -> None:
        super().__init__()
        self.cfg = cfg = eagle_layer_config(target, shape)
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h)
        with torch.no_grad():  # start near "the feature is the hidden state"
            self.fc.weight.mul_(0.1)
            self.fc.weight[:, h:] += torch.eye(h)
        self.layers = nn.ModuleList([_PlainDecoderLayer(cfg)])
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                      fused=False)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """embeds of x_{t+1}, hidden h_t, both [B, T, H] -> the layer's output stream [B, T, H]
        (before the target's final norm)."""
        cfg, layer = self.cfg, self.layers[0]
        assert isinstance(layer, _PlainDecoderLayer)
        b, t, _ = embeds.shape
        x = self.fc(torch.cat([embeds, hidden], -1))
        eps = cfg.rms_norm_eps
        h, _ = rms_norm_plain(x, None, layer.input_layernorm.weight, eps)
        attn = layer.self_attn
        q = attn.q_proj(h).view(b * t, cfg.num_heads, cfg.head_dim)
        k = attn.k_proj(h).view(b * t, cfg.num_kv_heads, cfg.head_dim)
        v = attn.v_proj(h).view(b, t, cfg.num_kv_heads, cfg.head_dim)
        positions = torch.arange(t, device=x.device).repeat(b)
        q, k = self.rotary(positions, q, k)
        q = q.view(b, t, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        rep = cfg.num_heads // cfg.num_kv_heads
        k = k.view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2).repeat_interleave(rep, 1)
        v = v.transpose(1, 2).repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=cfg.head_dim ** -0.5)
        x = x + attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))
        h, _ = rms_norm_plain(x, None, layer.post_attention_layernorm.weight, eps)
        mlp = layer.mlp
        return x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))


class EagleLayer(nn.Module):
    """The EAGLE layer at inference: Treadle's decoder layer over its own paged KV cache, with
    the target's embedding, final norm and lm_head."""

    def __init__(self, target: LlamaForCausalLM, shape: EagleLayerShape, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        cfg = eagle_layer_config(target.config, shape)
        self.config, self.target = cfg, [target]  # a list: not a submodule (its weights are the target's)
        dtype, no_method = target.dtype, (lambda name: None)
        device = target.norm.weight.device
        with torch.device(device):
            self.fc = Linear(2 * cfg.hidden_size, [cfg.hidden_size], True, dtype)
            rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
            attn = LlamaAttention(cfg, LLAMA_LAYOUT, target.backend, dtype, no_method, "model.layers.0", rotary)
            mlp = LlamaMLP(cfg, LLAMA_LAYOUT, dtype, no_method, "model.layers.0")
            self.layers = nn.ModuleList(
                [LlamaDecoderLayer(attn, mlp, cfg, ParallelContext.single(cfg.vocab_size))])
        self._load(tensors, dtype)

    def _load(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        params = dict(self.named_parameters())
        for name, tensor in tensors.items():
            if name.startswith("fc."):
                pname, shard = name, None
            else:
                pname, shard = LLAMA_LAYOUT.parameter_for(f"model.{name}")
            param = params[pname]
            loader = getattr(param, "weight_loader", None)
            tensor = tensor.to(dtype)
            if loader is not None:
                loader(param, tensor, shard)
            else:
                param.data.copy_(tensor)
        for module in self.modules():
            if isinstance(module, Linear):
                module.method.process_weights_after_loading(module)

    def forward(
        self,
        token_ids: torch.Tensor,  # [n]: x_{t+1}
        hidden: torch.Tensor,  # [n, H]: h_t (or the previous feature while chaining)
        positions: torch.Tensor,  # [n]: t
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [n, H]: the feature g_t (after the target's final norm)
        target = self.target[0]
        emb = vocab_embedding(target.embed_tokens, token_ids, target.dtype, target.parallel)
        x = self.fc(torch.cat([emb, hidden.to(emb.dtype)], -1))
        x, residual = self.layers[0](positions, x, None, kv_cache, meta)
        return target.norm(x, residual)[0]
