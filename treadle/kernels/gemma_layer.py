"""One C call for a Gemma 3 decoder stack on all-decode CPU steps (``csrc/gemma_layer.c``).

The Gemma form of ``treadle.kernels.layer``: each layer is a Llama layer's weights
(``DecoderLayerWeights``: its post_norm is the attention output's norm, its cos/sin table and
window the layer's own) plus Gemma's q/k head norms and the MLP's input and output norms. Every
layer reads the KV cache through its own slots and block tables (hybrid KV: one set per KV
group), handed over per step. This module knows no model or quantization classes.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import torch

from treadle.kernels import header, native
from treadle.kernels.layer import DecoderLayerWeights, KVCache, LayerArgs, bind_caches, layer_args


class GemmaLayerArgs(ctypes.Structure):
    """csrc/tq.h's ``tq_gemma_layer``."""

    _fields_ = header.struct_fields("tq_gemma_layer")


class GemmaLayerWeights(NamedTuple):
    base: DecoderLayerWeights  # post_norm: the attention output's norm
    q_norm: torch.Tensor  # [head_dim] float32
    k_norm: torch.Tensor  # [head_dim] float32
    pre_ff_norm: torch.Tensor  # [H] float32
    post_ff_norm: torch.Tensor  # [H] float32


class StepIndex(NamedTuple):
    """One layer's view of the step's KV slots (its KV group's)."""

    slots: torch.Tensor  # [B] int64 contiguous
    block_tables: torch.Tensor  # [B, max_blocks] int32 contiguous


class GemmaDecoderKernel:
    """The C layers bound to the weights of a model's consecutive Gemma 3 layers."""

    def __init__(self, weights: Sequence[GemmaLayerWeights]) -> None:
        self.weights = list(weights)
        n = len(self.weights)
        self._fn = native.kernel("tq_gemma_layers_decode")
        self._base = (LayerArgs * n)(*(layer_args(w.base) for w in self.weights))
        size, at = ctypes.sizeof(LayerArgs), ctypes.addressof(self._base)
        self._args = (GemmaLayerArgs * n)(*(
            GemmaLayerArgs(at + i * size, w.q_norm.data_ptr(), w.k_norm.data_ptr(), w.pre_ff_norm.data_ptr(),
                           w.post_ff_norm.data_ptr()) for i, w in enumerate(self.weights)))
        self._ptr = ctypes.addressof(self._args)
        self._slots, self._tables = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)()
        self._max_blocks = (ctypes.c_int64 * n)()
        self._caches: list[KVCache] = []

    def scratch_floats(self, batch: int, hidden: int) -> int:
        return max(w.base.scratch_floats(batch, hidden) for w in self.weights)

    def __call__(
        self,
        x: torch.Tensor,  # [B, H] float32 contiguous, the embeddings; overwritten with the last layer's output
        residual: torch.Tensor,  # [B, H] float32 contiguous; set to x, then the residual stream
        positions: torch.Tensor,  # [B] int64 contiguous
        kv_caches: Sequence[KVCache],  # one per layer
        index: Sequence[StepIndex],  # one per layer (layers of one KV group share theirs)
        seq_lens: torch.Tensor,  # [B] int32, new token included
        scratch: torch.Tensor,  # >= scratch_floats(B, H) float32
    ) -> None:
        self._caches = bind_caches(self._base, kv_caches, self._caches)
        assert len(index) == len(self._args)
        self._slots[:] = [i.slots.data_ptr() for i in index]
        self._tables[:] = [i.block_tables.data_ptr() for i in index]
        self._max_blocks[:] = [i.block_tables.shape[1] for i in index]
        self._fn(
            self._ptr, len(self._args), x.data_ptr(), residual.data_ptr(), 1, positions.data_ptr(), self._slots,
            self._tables, self._max_blocks, seq_lens.data_ptr(), seq_lens.shape[0], x.shape[1], scratch.data_ptr(),
        )
