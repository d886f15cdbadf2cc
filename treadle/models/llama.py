"""The Llama family (Llama, Mistral, Qwen2, SmolLM): one decoder, configured by its layout.

Forward takes flat token ids and positions of a whole batch, the per-layer paged
KV cache and the step's attention metadata, all as explicit arguments.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import ClassVar

import torch
from torch import nn

from treadle.config import ModelConfig
from treadle.distributed import ParallelContext, StageCarry, shard_config, stage_layers
from treadle.distributed.overlap import Phase, run_overlapped
from treadle.distributed.vocab import vocab_embedding, vocab_logits
from treadle.layers.activation import silu_and_mul
from treadle.layers.attention import AttentionBackend, AttentionMetadata, AttentionSpec
from treadle.layers.fused_decoder import DecoderStack
from treadle.layers.linear import Linear, LinearMethod
from treadle.layers.norm import RMSNorm
from treadle.layers.rotary import RotaryEmbedding
from treadle.models.layout import LLAMA_NORMS, LinearLayout, ModelLayout, llama_linears
from treadle.models.rank_shard import RankSharder

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, num_kv_heads, head_dim]
MethodFactory = Callable[[str], LinearMethod | None]


def make_linear(lin: LinearLayout, cfg: ModelConfig, dtype: torch.dtype, method: MethodFactory, prefix: str) -> Linear:
    """The Linear module a layout row describes, named ``{prefix}.{lin.name}`` for the method factory."""
    return Linear(lin.in_features(cfg), lin.output_sizes(cfg), lin.bias(cfg), dtype, method(f"{prefix}.{lin.name}"))


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layout: ModelLayout,
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
        self.qkv_proj = make_linear(layout.linear("self_attn.qkv_proj"), cfg, dtype, method, prefix)
        self.o_proj = make_linear(layout.linear("self_attn.o_proj"), cfg, dtype, method, prefix)
        self.rotary = rotary  # one table shared by every layer
        self.backend = backend

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head q/k transform before RoPE: none here (Qwen3 normalizes them)."""
        return q, k

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        spec = self.spec
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, spec.num_heads, spec.head_dim)
        k = k.view(-1, spec.num_kv_heads, spec.head_dim)
        v = v.view(-1, spec.num_kv_heads, spec.head_dim)
        q, k = self.rotary(positions, *self.normalize_qk(q, k))
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, spec)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: ModelLayout, dtype: torch.dtype, method: MethodFactory,
                 prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = make_linear(layout.linear("mlp.gate_up_proj"), cfg, dtype, method, prefix)
        self.down_proj = make_linear(layout.linear("mlp.down_proj"), cfg, dtype, method, prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Under tensor parallelism the attention's o_proj and the MLP's down_proj are row-parallel:
    each rank's output is a partial sum, completed here by an all-reduce over the TP group."""

    def __init__(self, attention: LlamaAttention, mlp: nn.Module, cfg: ModelConfig,
                 parallel: ParallelContext) -> None:
        super().__init__()
        self.parallel = parallel
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream); ``residual`` None on the first layer (x is the stream)."""
        h, residual = self.attention_part(positions, x, residual, kv_cache, meta)
        h, residual = self.mlp_part(self.parallel.all_reduce(h), residual)
        return self.parallel.all_reduce(h), residual

    def attention_part(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                       kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Norm and attention: (this rank's partial o_proj output, residual stream)."""
        h, residual = self.input_layernorm(x, residual)
        return self.self_attn(positions, h, kv_cache, meta), residual

    def mlp_part(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Norm and MLP on the reduced attention output: (partial down_proj output, residual)."""
        h, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(h), residual


LLAMA_LAYOUT = ModelLayout(linears=llama_linears(), norms=LLAMA_NORMS)


class LayerByLayer:
    """The decoder stack as its layer modules, run one after another (P/D layer-wise start:
    waiting for each layer's KV before it). Each entry of ``layers`` may itself have been
    swapped for its fused form."""

    def __init__(self, layers: nn.ModuleList, stage: range) -> None:
        self.layers, self.stage = layers, stage

    def __call__(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                 kv_caches: list[KVCache], meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        for i in self.stage:
            if meta.wait_for_layer is not None:  # P/D layer-wise start: layer i's KV must have landed
                meta.wait_for_layer(i)
            x, residual = self.layers[i](positions, x, residual, kv_caches[i], meta.for_layer(i))
        assert residual is not None
        return x, residual


class LlamaForCausalLM(nn.Module):
    """Llama, Mistral (sliding window), Qwen2 (qkv bias), SmolLM; subclasses change the
    layout and the attention class (Qwen3, Phi-3).

    Under ``parallel`` (default: one rank) the model holds one tensor-parallel rank's part of
    every layer (``shard_config``: its heads, KV heads, intermediate columns, vocabulary rows)
    and only its pipeline stage's decoder layers (the others are ``nn.Identity`` placeholders,
    so parameter names keep the checkpoint's layer numbers)."""

    layout: ClassVar[ModelLayout] = LLAMA_LAYOUT
    attention_cls: ClassVar[type[LlamaAttention]] = LlamaAttention

    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype = torch.float32,
        method: MethodFactory | None = None,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        method = method or (lambda name: None)
        self.config = cfg
        self.parallel = parallel = parallel or ParallelContext.single(cfg.vocab_size)
        full, cfg = cfg, shard_config(cfg, parallel.tp_size, parallel.tp_rank)
        self.dtype = dtype
        self.backend = backend
        self.stage = stage_layers(cfg.num_layers, parallel.pp_size, parallel.pp_rank)
        self.shard = RankSharder(self.layout, full, parallel.tp_size, parallel.tp_rank)
        layout = self.layout
        # [vocab, hidden]: looked up by ids, and the lm_head too when tied
        self.embed_tokens = Linear(cfg.hidden_size, [cfg.vocab_size], False, dtype, method(layout.embed))
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList()
        for i in range(cfg.num_layers):
            if i not in self.stage:
                self.layers.append(nn.Identity())
                continue
            self.layers.append(self.make_layer(cfg, i, backend, dtype, method, rotary))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # the decoder stack: the layer modules one by one; the runner's planner may swap in its fused
        # form (treadle.worker.fused_layers), as it swaps single layers
        self.decoder: DecoderStack = LayerByLayer(self.layers, self.stage)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.weight.data = module.weight.data.to(dtype)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, [cfg.vocab_size], False, dtype, method(layout.lm_head))

    def make_layer(self, cfg: ModelConfig, layer: int, backend: AttentionBackend, dtype: torch.dtype,
                   method: MethodFactory, rotary: RotaryEmbedding) -> nn.Module:
        """Decoder layer ``layer`` (``cfg``: this rank's part; ``rotary``: the model's RoPE
        table); Gemma 3 gives each layer its own window and table here."""
        p = f"{self.layout.layer_prefix}.{layer}"
        attn = self.attention_cls(cfg, self.layout, backend, dtype, method, p, rotary)
        return LlamaDecoderLayer(attn, self.make_mlp(cfg, layer, dtype, method, p), cfg, self.parallel)

    def make_mlp(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, method: MethodFactory,
                 prefix: str) -> nn.Module:
        """Decoder layer ``layer``'s MLP (``cfg``: this rank's part); mixture-of-experts
        families return their sparse block here (``treadle.models.moe``)."""
        return LlamaMLP(cfg, self.layout, dtype, method, prefix)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCache],  # one per layer
        meta: AttentionMetadata,
        carry: StageCarry | None = None,  # from the previous pipeline stage (None on the first)
    ) -> torch.Tensor:  # [num_tokens, hidden_size]; a StageCarry on any stage but the last
        x, residual = (self.embed(input_ids), None) if carry is None else carry
        x, residual = self.decoder(positions, x, residual, kv_caches, meta)
        if not self.parallel.is_last_stage:
            assert residual is not None
            return StageCarry(x, residual)  # type: ignore[return-value]
        x, _ = self.norm(x, residual)
        return x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden_size]
        """The input embeddings (Gemma scales them)."""
        return vocab_embedding(self.embed_tokens, input_ids, self.dtype, self.parallel)

    def forward_overlapped(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        micro: list[tuple[torch.Tensor, AttentionMetadata]],  # (positions, metadata) per micro-batch
        kv_caches: list[KVCache],
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        """``forward`` on one stage-less TP rank, the step cut into micro-batches (token order)
        whose all-reduces overlap each other's compute (``treadle.distributed.overlap``)."""
        sizes = [pos.shape[0] for pos, _ in micro]
        xs = [self.embed(ids) for ids in input_ids.split(sizes)]
        phases: list[Phase] = []
        for i in self.stage:
            layer, cache = self.layers[i], kv_caches[i]
            assert isinstance(layer, LlamaDecoderLayer)  # this stage's layers are real ones

            def attention(m: int, x: torch.Tensor, r: torch.Tensor | None,
                          layer: LlamaDecoderLayer = layer, cache: KVCache = cache) -> tuple[torch.Tensor, torch.Tensor]:
                return layer.attention_part(micro[m][0], x, r, cache, micro[m][1])

            def mlp(m: int, x: torch.Tensor, r: torch.Tensor | None,
                    layer: LlamaDecoderLayer = layer) -> tuple[torch.Tensor, torch.Tensor]:
                assert r is not None  # the attention phase always hands on the residual
                return layer.mlp_part(x, r)

            phases += [attention, mlp]
        outs = run_overlapped(phases, xs, self.parallel)
        return torch.cat([self.norm(x, residual)[0] for x, residual in outs])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:  # [n, vocab] float32
        """Logits of every row, on the sampling rank; None on the other ranks of the last
        stage (which must call this too: under TP the logits are gathered)."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return vocab_logits(head, hidden, self.parallel)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load Hugging Face-named tensors; returns the names of parameters filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if self.layout.is_ignored(hf_name, self.config):
                continue
            layer = self.layout.layer_index(hf_name)
            if layer is not None and layer not in self.stage:
                continue  # another pipeline stage's layer
            tensor = self.shard(hf_name, tensor)
            name, shard = self.layout.parameter_for(hf_name)
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
