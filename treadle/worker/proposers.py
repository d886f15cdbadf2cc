"""Builds the runner's proposer from the resolved SpeculativeConfig: the n-gram lookup, or a
draft model (loaded through the loaders, or the target's first layers) with its KV tensors
over the target's block pool (``treadle.spec_decode.proposer``)."""
from __future__ import annotations

import torch

from treadle.config import CacheConfig, SpeculativeConfig
from treadle.layers.attention.kv_quant import cache_dtype
from treadle.loaders import load_model
from treadle.models.llama import KVCache, LlamaForCausalLM
from treadle.spec_decode.draft_model import DraftModelProposer, LayerSkipDraft
from treadle.spec_decode.ngram import NgramProposer
from treadle.spec_decode.proposer import Proposer
from treadle.worker.fused_layers import fuse_decoder_layers
from treadle.worker.model_runner import allocate_kv_cache


def build_proposer(spec: SpeculativeConfig | None, target: LlamaForCausalLM, target_kv: list[KVCache],
                   cache: CacheConfig, device: torch.device, fused_layers: bool) -> Proposer | None:
    """None without speculation. Call after the target's layers are fused (a layer-skip draft
    runs the target's own layer modules)."""
    if spec is None:
        return None
    k = spec.num_speculative_tokens
    if spec.method == "ngram":
        return NgramProposer(k, spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method != "draft_model":
        raise NotImplementedError(spec.method)  # the resolver admits no other method yet
    max_positions = target.config.max_position_embeddings
    if spec.draft_layers is not None:
        return DraftModelProposer(k, LayerSkipDraft(target, spec.draft_layers), target_kv[: spec.draft_layers],
                                  target.backend, cache.block_size, max_positions, True, device)
    assert spec.model is not None
    loaded = load_model(spec.model, target.backend, target.dtype, device, "auto")
    if fused_layers and device.type == "cpu":
        fuse_decoder_layers(loaded.model)
    kv = allocate_kv_cache(loaded.config, cache.num_blocks, cache.block_size, cache_dtype(cache.kv_cache_dtype),
                           device)  # the target's cache dtype: the planner sized the shared blocks with it
    return DraftModelProposer(k, loaded.model, kv, target.backend, cache.block_size,
                              min(max_positions, loaded.config.max_position_embeddings), False, device)
