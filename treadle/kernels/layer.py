"""One C call per Llama-style decoder layer on all-decode CPU steps (``csrc/layer.c``).

``layer.c`` chains the kernels the layer's modules would call one by one (same kernels,
same order, same values), so the only difference from the module path is the Python it
skips. Everything it reads is handed over explicitly: the layer's weights as GGUF-block
tensors with their block type names, or bfloat16 tensors ("BF16" rows) (``DecoderLayerWeights``), the step's decode index
tensors, the KV cache and a scratch buffer. Which layers qualify is decided by the caller
(``treadle.worker.fused_layers``); this module knows no model or quantization classes.
"""
from __future__ import annotations

import ctypes
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from treadle.kernels import header, native
from treadle.kernels.attention import KV_FORMATS


class LayerArgs(ctypes.Structure):
    """csrc/tq.h's ``tq_decoder_layer``: one layer's weights, shapes and KV cache (the fields
    read from the header)."""

    _fields_ = header.struct_fields("tq_decoder_layer")


def block_layouts(segments: Sequence[native.Segments]) -> ctypes.Array:
    """The block-type segments of qkv / o / gate_up / down ((type name, rows) runs, e.g.
    (("Q4_K", 384), ("Q6_K", 128)) for a q/k/v of mixed types, (("BF16", 960),) for bfloat16
    rows) as the kernel's tq_layout[4]."""
    return (native.Layout * 4)(*(native.layout(s) for s in segments))


class DecoderLayerWeights(NamedTuple):
    """One decoder layer's tensors and shapes, as the C layer reads them."""

    layouts: ctypes.Array  # tq_layout[4], from block_layouts
    input_norm: torch.Tensor  # [H] float32
    post_norm: torch.Tensor  # [H] float32
    eps: float
    qkv: torch.Tensor  # [bytes] uint8 (or [rows, H] bfloat16): q + 2 kv rows of H inputs, in the layout's segments
    qkv_bias: torch.Tensor | None  # [q + 2 kv] float32
    o: torch.Tensor  # [bytes] uint8: H rows of q inputs
    gate_up: torch.Tensor  # [bytes] uint8: 2 I rows of H inputs
    down: torch.Tensor  # [bytes] uint8: H rows of I inputs
    cos_sin: torch.Tensor  # [max_positions, head_dim] float32 (RoPE table)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    sliding_window: int | None
    scale: float

    def scratch_floats(self, batch: int, hidden: int) -> int:
        q = self.num_heads * self.head_dim
        qkv = q + 2 * self.num_kv_heads * self.head_dim
        return batch * (2 * hidden + qkv + q + 3 * self.intermediate)


KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, kv_heads, D (+4)] contiguous,
# float32 or a quantized cache (kernels.attention.KV_FORMATS)


def layer_args(w: DecoderLayerWeights) -> LayerArgs:
    """The C view of one layer's weights (their pointers: they must neither move nor be freed
    while it is used); the KV cache is bound per call (``bind_cache``)."""
    return LayerArgs(
        w.input_norm.data_ptr(), w.post_norm.data_ptr(), ctypes.addressof(w.layouts), w.qkv.data_ptr(),
        w.o.data_ptr(), w.gate_up.data_ptr(), w.down.data_ptr(),
        None if w.qkv_bias is None else w.qkv_bias.data_ptr(), w.cos_sin.data_ptr(), None, None,
        w.num_heads, w.num_kv_heads, w.head_dim, w.intermediate, w.sliding_window or 0, 0, w.eps, w.scale, 0,
    )


def bind_cache(args: LayerArgs, kv_cache: KVCache) -> None:
    k_cache, v_cache = kv_cache
    args.k_cache, args.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
    args.block_size, args.kv_format = k_cache.shape[1], KV_FORMATS[k_cache.dtype][0]


def bind_caches(args: Iterable[LayerArgs], kv_caches: Sequence[KVCache], bound: list[KVCache]) -> list[KVCache]:
    """Bind each layer's KV cache unless these are the tensors bound last (``bound``); -> the
    caches bound now."""
    if len(kv_caches) == len(bound) and all(a[0] is b[0] and a[1] is b[1] for a, b in zip(kv_caches, bound)):
        return bound
    for a, cache in zip(args, kv_caches, strict=True):
        bind_cache(a, cache)
    return list(kv_caches)


class DecoderLayerKernel:
    """The C layers bound to the weights of one or more consecutive layers (a model's whole
    stack: one call per step, no Python between layers). Holds the weights (``weights``)."""

    def __init__(self, weights: Sequence[DecoderLayerWeights]) -> None:
        self.weights = list(weights)
        self._fn = native.kernel("tq_llama_layers_decode")
        self._args = (LayerArgs * len(self.weights))(*map(layer_args, self.weights))
        self._ptr = ctypes.addressof(self._args)
        self._caches: list[KVCache] = []

    def __call__(
        self,
        x: torch.Tensor,  # [B, H] float32 contiguous; overwritten with the last layer's MLP output
        residual: torch.Tensor,  # [B, H] float32 contiguous; the residual stream, updated in place
        first: bool,  # residual is set to x (the model's first layer), else x is added into it
        positions: torch.Tensor,  # [B] int64 contiguous
        kv_caches: Sequence[KVCache],  # one per layer
        slots: torch.Tensor,  # [B] int64, cache slot of each new K/V row
        block_tables: torch.Tensor,  # [B, max_blocks] int32 contiguous
        seq_lens: torch.Tensor,  # [B] int32, new token included
        scratch: torch.Tensor,  # >= weights[0].scratch_floats(B, H) float32 (every layer's shapes alike)
    ) -> None:
        self._caches = bind_caches(self._args, kv_caches, self._caches)
        self._fn(
            self._ptr, len(self._args), x.data_ptr(), residual.data_ptr(), int(first), positions.data_ptr(),
            slots.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(), seq_lens.shape[0], block_tables.shape[1],
            x.shape[1], scratch.data_ptr(),
        )
