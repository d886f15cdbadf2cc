"""A decoder layer that runs as one C call on all-decode CPU steps (``treadle.kernels.layer``)
and hands every other step to the module it replaced.

Swapped in after loading by the runner's planner (``treadle.worker.fused_layers``), which
gives it the layer's weights explicitly. The C layer chains the same kernels the module
path calls one by one, so both give the same bits; the swap only removes Python::

    step (meta.plan)                     FusedDecoderLayer.forward
    all-decode, CPU kernels, float32 --> DecoderLayerKernel(x, residual, ...)  (in place)
    anything else                    --> self.module(positions, x, residual, kv_cache, meta)

The KV cache may be float32 or quantized (int8 / fp8 rows with scales, ``kv_quant``): the C
layer's attention quantizes the new rows and dequantizes what it reads, as the module path does.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from treadle.kernels.attention import KV_FORMATS
from treadle.kernels.layer import DecoderLayerKernel, DecoderLayerWeights, KVCache
from treadle.layers.attention.metadata import AttentionMetadata


class Workspace:
    """One float32 scratch buffer shared by a model's fused layers (they run one at a time)."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.float32)

    def get(self, numel: int) -> torch.Tensor:
        if self._buf.numel() < numel:
            self._buf = torch.empty(numel, dtype=torch.float32)
        return self._buf


def _takes(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.is_contiguous()


def _takes_cache(t: torch.Tensor) -> bool:  # float32 or quantized (int8 / fp8 rows with scales)
    return t.dtype in KV_FORMATS and t.is_contiguous()


def _run(kernel: DecoderLayerKernel, workspace: Workspace, positions: torch.Tensor, x: torch.Tensor,
         residual: torch.Tensor | None, kv_caches: list[KVCache], meta: AttentionMetadata,
         ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The kernel's layers on this step -> (MLP output, residual stream), or None when the step
    is not one it takes (not all-decode, or tensors of another dtype or layout). The caches are
    allocated alike, so the first one is checked for all."""
    args = None if meta.plan is None else meta.plan.decode_kernel_args
    cache = kv_caches[0]
    if (
        args is None
        or not (_takes(x) and _takes_cache(cache[0]) and _takes_cache(cache[1]))
        or (residual is not None and not _takes(residual))
    ):
        return None
    first = residual is None
    if residual is None:
        residual = torch.empty_like(x)
    scratch = workspace.get(kernel.weights[0].scratch_floats(x.shape[0], x.shape[1]))  # every layer's shapes alike
    kernel(x, residual, first, positions.to(torch.int64).contiguous(), kv_caches, *args, scratch)
    return x, residual


class FusedDecoderLayer(nn.Module):
    """Same ``forward`` contract as the decoder layer it wraps: (positions, x, residual,
    kv_cache, meta) -> (MLP output, residual stream), residual None on the first layer."""

    def __init__(self, module: nn.Module, weights: DecoderLayerWeights, workspace: Workspace) -> None:
        super().__init__()
        self.module = module  # the module path, for steps the C layer does not take
        self.kernel = DecoderLayerKernel([weights])
        self.workspace = workspace

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        x: torch.Tensor,  # [num_tokens, hidden]
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = _run(self.kernel, self.workspace, positions, x, residual, [kv_cache], meta)
        return self.module(positions, x, residual, kv_cache, meta) if out is None else out


# A model's decoder stack: (positions, x, residual or None on the first stage, one KV cache per
# layer, meta) -> (last layer's output, residual stream). The model's own is its layer modules one
# by one (models/llama.py LayerByLayer); FusedDecoderStack is the form the runner swaps in.
DecoderStack = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", list[KVCache], AttentionMetadata],
                        tuple[torch.Tensor, torch.Tensor]]


class FusedDecoderStack:
    """All of a model's decoder layers, each a FusedDecoderLayer, as one C call on the steps
    they take (no Python between layers); any other step goes to ``fallback`` (the stack it
    replaced), which runs them layer by layer. The KV caches are bound on first use and again
    whenever the tensors change."""

    def __init__(self, layers: list[FusedDecoderLayer], fallback: DecoderStack) -> None:
        self.kernel = DecoderLayerKernel([w for layer in layers for w in layer.kernel.weights])
        self.workspace = layers[0].workspace
        self.fallback = fallback

    def __call__(
        self,
        positions: torch.Tensor,  # [num_tokens]
        x: torch.Tensor,  # [num_tokens, hidden], the embeddings
        residual: torch.Tensor | None,  # None: x is the embeddings (the one-stage model this is made for)
        kv_caches: list[KVCache],  # one per layer, all allocated alike (the first one is checked)
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # P/D layer-wise start: Python waits between layers; hybrid KV: each layer has its own tables
        out = None if meta.wait_for_layer is not None or meta.layer_meta is not None or residual is not None else \
            _run(self.kernel, self.workspace, positions, x, None, kv_caches, meta)
        return self.fallback(positions, x, residual, kv_caches, meta) if out is None else out
