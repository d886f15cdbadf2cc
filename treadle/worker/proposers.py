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
from treadle.spec_decode.head_format import DRAFT_VOCAB, HEAD_METHODS, eagle_layer_config, load_head
from treadle.spec_decode.head_proposers import DraftVocab, EagleProposer, MedusaProposer
from treadle.spec_decode.heads import EagleLayer, MedusaHeads
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
    if spec.method in HEAD_METHODS:
        return _head_proposer(spec, target, cache, device)
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


def _head_proposer(spec: SpeculativeConfig, target: LlamaForCausalLM, cache: CacheConfig,
                   device: torch.device) -> Proposer:
    """An EAGLE or Medusa head (``spec.model``: its directory, filled in by the resolver)."""
    assert spec.model is not None
    config, tensors = load_head(spec.model, target.config, spec.method)
    k = spec.num_speculative_tokens
    vocab = DraftVocab(target, tensors.pop(DRAFT_VOCAB, None))
    if config.layer is None:  # medusa
        heads = MedusaHeads(target.config.hidden_size, config.num_speculative_tokens)
        heads.load_state_dict(tensors)
        return MedusaProposer(k, heads.to(device).eval(), target, vocab)
    layer = EagleLayer(target, config.layer, tensors)
    kv = allocate_kv_cache(eagle_layer_config(target.config, config.layer), cache.num_blocks, cache.block_size,
                           cache_dtype(cache.kv_cache_dtype), device)
    # the target's hidden state per slot, for the lazy catch-up (the planner counts it: spec_decode/options.py draft_head_token_bytes)
    hidden = torch.zeros(cache.num_blocks * cache.block_size, target.config.hidden_size, dtype=target.dtype,
                         device=device)
    return EagleProposer(k, layer, kv[0], hidden, cache.block_size, target.config.max_position_embeddings, device,
                         vocab)
