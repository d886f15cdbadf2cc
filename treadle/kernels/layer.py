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
from collections.abc import Sequence
from typing import NamedTuple

import torch

from treadle.kernels import native
from treadle.kernels.attention import KV_FORMATS

_SIGNATURE = "PPCPPFPPPPPPPPPPPPPIIIIIIIIIFCP"


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


class DecoderLayerKernel:
    """The C layer bound to one layer's weights: their pointers and shapes are read once here
    (the weights must neither move nor be freed while this lives; it holds them)."""

    def __init__(self, w: DecoderLayerWeights) -> None:
        self.weights = w
        self._fn = native.kernel("tq_llama_layer_decode", _SIGNATURE)
        bias = None if w.qkv_bias is None else w.qkv_bias.data_ptr()
        self._norms = (w.input_norm.data_ptr(), w.post_norm.data_ptr(), w.eps, ctypes.addressof(w.layouts),
                       w.qkv.data_ptr(), bias, w.o.data_ptr(), w.gate_up.data_ptr(), w.down.data_ptr(),
                       w.cos_sin.data_ptr())
        self._shape = (w.num_heads, w.num_kv_heads, w.head_dim, w.intermediate, w.sliding_window or 0, w.scale)

    def __call__(
        self,
        x: torch.Tensor,  # [B, H] float32 contiguous; overwritten with the layer's MLP output
        residual: torch.Tensor,  # [B, H] float32 contiguous; the residual stream, updated in place
        first: bool,  # residual is set to x (the first layer), else x is added into it
        positions: torch.Tensor,  # [B] int64 contiguous
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # each [num_blocks, block_size, kv_heads, D (+4)] contiguous,
        # float32 or a quantized cache (kernels.attention.KV_FORMATS)
        slots: torch.Tensor,  # [B] int64, cache slot of each new K/V row
        block_tables: torch.Tensor,  # [B, max_blocks] int32 contiguous
        seq_lens: torch.Tensor,  # [B] int32, new token included
        scratch: torch.Tensor,  # >= weights.scratch_floats(B, H) float32
    ) -> None:
        k_cache, v_cache = kv_cache
        self._fn(
            x.data_ptr(), residual.data_ptr(), int(first), *self._norms, positions.data_ptr(),
            k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
            seq_lens.shape[0], block_tables.shape[1], k_cache.shape[1], x.shape[1], *self._shape,
            KV_FORMATS[k_cache.dtype][0], scratch.data_ptr(),
        )
