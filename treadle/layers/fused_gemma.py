"""A Gemma 3 decoder stack that runs as one C call on all-decode CPU steps
(``treadle.kernels.gemma_layer``) and hands every other step to the stack it replaced.

Swapped in after loading by the runner's planner (``treadle.worker.fused_layers``), as
``FusedDecoderStack`` is for the Llama block. The C stack chains the kernels the modules call
one by one, so both give the same bits::

    step                                              FusedGemmaStack
    all-decode (every layer's KV group), CPU, float32 --> GemmaDecoderKernel (one call, all layers)
    anything else (prefill, P/D layer-wise start)     --> fallback (the layer modules one by one)

Hybrid KV: with ``meta.layer_meta`` each layer reads its own group's slots and block tables.
"""
from __future__ import annotations

import torch

from treadle.kernels.gemma_layer import GemmaDecoderKernel, GemmaLayerWeights, StepIndex
from treadle.kernels.layer import KVCache
from treadle.layers.attention.metadata import AttentionMetadata
from treadle.layers.fused_decoder import DecoderStack, Workspace, _takes, _takes_cache


def _index(meta: AttentionMetadata, n: int) -> tuple[list[StepIndex], torch.Tensor] | None:
    """Each layer's (slots, block tables) and the step's seq_lens, or None unless every layer's
    plan is an all-decode step for the C kernels."""
    args = None if meta.plan is None else meta.plan.decode_kernel_args
    if args is None:
        return None
    if meta.layer_meta is None:
        return [StepIndex(args.slots, args.block_tables)] * n, args.seq_lens
    index: list[StepIndex] = []
    seen: dict[int, StepIndex] = {}  # layers of one group share its metadata object
    for m in meta.layer_meta[:n]:
        step = seen.get(id(m))
        if step is None:
            a = None if m.plan is None else m.plan.decode_kernel_args
            if a is None:
                return None
            step = seen[id(m)] = StepIndex(a.slots, a.block_tables)
        index.append(step)
    return index, args.seq_lens


class FusedGemmaStack:
    """All of a one-stage, one-rank Gemma 3 model's decoder layers as one C call on the steps it
    takes; any other step goes to ``fallback``. KV caches are bound on first use and again
    whenever the tensors change."""

    def __init__(self, weights: list[GemmaLayerWeights], fallback: DecoderStack) -> None:
        self.kernel = GemmaDecoderKernel(weights)
        self.workspace = Workspace()
        self.fallback = fallback

    def __call__(
        self,
        positions: torch.Tensor,  # [num_tokens]
        x: torch.Tensor,  # [num_tokens, hidden], the embeddings
        residual: torch.Tensor | None,  # None: x is the embeddings
        kv_caches: list[KVCache],  # one per layer, all allocated alike (the first one is checked)
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        step = None
        if meta.wait_for_layer is None and residual is None and _takes(x) and all(map(_takes_cache, kv_caches[0])):
            step = _index(meta, len(self.kernel.weights))
        if step is None:
            return self.fallback(positions, x, residual, kv_caches, meta)
        index, seq_lens = step
        residual = torch.empty_like(x)
        scratch = self.workspace.get(self.kernel.scratch_floats(x.shape[0], x.shape[1]))
        self.kernel(x, residual, positions.to(torch.int64).contiguous(), kv_caches, index, seq_lens, scratch)
        return x, residual
