"""GGUF block-quantized weights kept quantized in memory and multiplied by Treadle's C
kernels (``treadle/kernels/csrc/qmatmul.c``), which dequantize on the fly: the legacy types
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (blocks of 32 inputs) and the K-quants Q2_K, Q3_K, Q4_K, Q5_K,
Q6_K (super-blocks of 256 with 6- or 8-bit sub-block scales). ``csrc/qblocks.h`` documents
every layout; the gguf package's reference dequantizer is the oracle the kernels are tested
against (``dequantize_blocks``).

A layer keeps its rows exactly as the file has them (fused q/k/v or gate/up shards are
stacked row-wise), so resident memory is the file's size; with 8-bit activations at load, its
Q4_0 / Q4_1 / Q4_K / Q6_K rows are repacked in place 8 at a time (same bytes: ``process_weights_after_loading``). A fused layer whose shards differ
in type -- llama.cpp's K-quant mixes give ``attn_v`` more bits than ``attn_q`` -- keeps each
shard's rows in its own type, as runs of rows ("segments") multiplied in one call.
Activations are rounded per block of 32 inside the kernel, to 16 bits (the default, and always
for Q2_K / Q3_K: results equal the dequantized reference up to that rounding and float32
summation order, so greedy output matches transformers) or, opted into with
``TREADLE_ACTIVATION_BITS=8``, to 8 bits for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K
(``csrc/q8act.c``: llama.cpp's rounding; SmolLM2's prompt ~2x and batch-1 decode ~1.2x faster than
16-bit, perplexity +0.32 %, greedy output no longer kept; Q4_K/Q6_K rows ~3.5-5x at 16-128
activation rows; Gemma 3 270M Q4_K_M perplexity -0.17 % when measured, docs/kernels.md). The same method
serves the embedding (rows gathered and dequantized) and a tied or quantized lm_head (a
matmul over the same bytes).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from treadle import envs
from treadle.config import TreadleError
from treadle.kernels import native
from treadle.layers.linear import Linear, LinearMethod
from treadle.quantization.methods.weight_only import shard_rows

NATIVE_TYPES = tuple(native.QTYPES)  # the block types the C kernels read


def block_shape(qtype: str) -> tuple[int, int]:
    """(inputs, bytes) of one block of ``qtype`` (32 or 256 inputs), from the gguf package."""
    return GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]


def row_bytes(qtype: str, in_features: int) -> int:
    inputs, nbytes = block_shape(qtype)
    return in_features // inputs * nbytes


class GGUFBlocks(NamedTuple):
    """Raw quantized rows straight from a GGUF file, rows already in HF order."""

    qtype: str  # a GGUF type name, e.g. "Q4_K"
    data: torch.Tensor  # [rows, row_bytes(qtype, in_features)] uint8
    shape: tuple[int, int]  # [out_features, in_features]


def dequantize_blocks(b: GGUFBlocks) -> torch.Tensor:  # [rows, in] float32
    """The blocks' exact values, by the gguf package's reference dequantizer (numpy): the
    oracle the kernels are tested against, independent of them."""
    from gguf.quants import dequantize

    values = dequantize(b.data.numpy(), GGMLQuantizationType[b.qtype])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(b.shape)


def quantize_blocks(w: torch.Tensor, qtype: str) -> GGUFBlocks:
    """A float [rows, in] tensor as GGUF blocks (the gguf package's reference quantizer, which
    has the legacy types but no K-quants)."""
    from gguf.quants import quantize

    data = quantize(w.detach().float().cpu().numpy(), GGMLQuantizationType[qtype])
    return GGUFBlocks(qtype, torch.from_numpy(data), (w.shape[0], w.shape[1]))


class BlockWidthError(TreadleError, ValueError):
    """A layer's input width is not a whole number of its block type's inputs."""


class GGUFBlockMethod(LinearMethod):
    """A layer whose weight is GGUF blocks, one type per shard (``qtypes``: one name for every
    shard, or one per shard of ``output_sizes``), stored as one uint8 vector: each shard's rows
    of ``row_bytes`` in row order. One instance per layer. Shards arrive as blocks (a GGUF file)
    or as float tensors, quantized on arrival with the gguf package's own quantizer
    (``--quantization int8|int4`` on a float checkpoint)."""

    def __init__(self, qtypes: str | Sequence[str]) -> None:
        self.qtypes = (qtypes,) if isinstance(qtypes, str) else tuple(qtypes)
        for qtype in self.qtypes:
            if qtype not in NATIVE_TYPES:
                raise ValueError(f"unsupported GGUF block type {qtype!r}")
        self.segments: native.Segments = ()

    def _shard_types(self, layer: Linear) -> list[str]:
        if len(self.qtypes) == 1:
            return list(self.qtypes) * len(layer.output_sizes)
        if len(self.qtypes) != len(layer.output_sizes):
            raise ValueError(f"{len(self.qtypes)} block types for {len(layer.output_sizes)} shards")
        return list(self.qtypes)

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        segments: list[tuple[str, int]] = []
        for qtype, rows in zip(self._shard_types(layer), layer.output_sizes):
            inputs = block_shape(qtype)[0]
            if layer.in_features % inputs:
                raise BlockWidthError(f"{qtype} blocks need in_features divisible by {inputs}, not "
                                      f"{layer.in_features} (a layer split across tensor-parallel ranks must keep "
                                      "whole blocks: choose another tensor_parallel_size)")
            if segments and segments[-1][0] == qtype:
                segments[-1] = (qtype, segments[-1][1] + rows)
            else:
                segments.append((qtype, rows))
        self.segments = tuple(segments)
        total = sum(rows * row_bytes(qtype, layer.in_features) for qtype, rows in self.segments)
        weight = nn.Parameter(torch.empty(total, dtype=torch.uint8), requires_grad=False)
        weight.weight_loader = lambda p, t, s=None: self.load_shard(layer, t, s)  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)

    def load_shard(self, layer: Linear, blocks: GGUFBlocks | torch.Tensor, shard: int | None) -> None:
        types = self._shard_types(layer)
        if shard is None and len(set(types)) > 1:
            raise ValueError("a layer of mixed block types is loaded shard by shard")
        qtype = types[shard or 0]
        if isinstance(blocks, torch.Tensor) and blocks.is_floating_point():
            blocks = quantize_blocks(blocks, qtype)
        if not isinstance(blocks, GGUFBlocks) or blocks.qtype != qtype:
            got = blocks.qtype if isinstance(blocks, GGUFBlocks) else f"a {blocks.dtype} tensor"
            raise ValueError(f"expected {qtype} blocks, got {got}")
        start, rows = shard_rows(layer, shard)
        if tuple(blocks.shape) != (rows, layer.in_features):
            raise ValueError(f"shape mismatch: expected {(rows, layer.in_features)}, got {tuple(blocks.shape)}")
        offset = sum(n * row_bytes(t, layer.in_features) for t, n in zip(types, layer.output_sizes[: shard or 0]))
        layer.weight.data[offset : offset + blocks.data.numel()] = blocks.data.reshape(-1)

    def process_weights_after_loading(self, layer: Linear) -> None:
        """With 8-bit activations (``TREADLE_ACTIVATION_BITS=8`` at load), Q4_0 / Q4_1 / Q5_0 / Q5_1 /
        Q8_0 / Q4_K / Q6_K segments of whole groups of 8 rows are repacked in place (``native.pack_rows``: same bytes,
        so resident memory is unchanged), so the kernel reads a group's block with loads and
        masks instead of transposing 8 rows on every call; with 16-bit ones, in the zmm builds
        (``native.packs_at_16_bits``), the Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K segments, which then
        take the same 16-bit activations split in two bytes. Packed Q6_K rows always take 8-bit
        activations; embedding lookups read packed rows back as the file had them."""
        if not native.available():
            return
        bits = envs.activation_bits()
        if bits == 8:
            packable = set(native.PACKED.values())
        elif native.packs_at_16_bits():
            packable = set(native.SPLIT_16)
        else:
            return
        segments, offset = [], 0
        for qtype, rows in self.segments:
            nbytes = rows * row_bytes(native.PACKED.get(qtype, qtype), layer.in_features)
            if qtype in packable and rows % 8 == 0:
                qtype = native.pack_rows(qtype, layer.weight.data[offset : offset + nbytes], rows, layer.in_features)
            segments.append((qtype, rows))
            offset += nbytes
        self.segments = tuple(segments)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        bias = None if layer.bias is None else layer.bias.float().contiguous()
        return native.qmatmul(self.segments, layer.weight, x, bias).to(x.dtype)

    def embedding(self, layer: Linear, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        (qtype, _), = self.segments
        return native.gather_rows(qtype, layer.weight, ids, layer.in_features).to(dtype)


class GGUFNativePlan:
    """Which layers of a GGUF model stay quantized, decided from the file's tensor types:
    every linear layer, the embedding and lm_head whose shards are all of NATIVE_TYPES (a fused
    layer's shards may differ) with rows of whole blocks; anything else is dequantized to float
    at load. Without Treadle's C kernels (no C compiler, or ``TREADLE_NATIVE_KERNELS=0``)
    everything is dequantized."""

    def __init__(self, tensors: dict[str, tuple[str, tuple[int, ...]]],
                 shard_names: Callable[[str], list[str]]) -> None:
        self.tensors = tensors  # HF weight name -> (GGUF type name, HF shape)
        self.shard_names = shard_names  # layer name -> its checkpoint weights (the model layout's)
        self._raw: set[str] = set()

    def method(self, layer_name: str) -> LinearMethod | None:
        """The factory handed to the model: ``Callable[[str], LinearMethod | None]``."""
        names = self.shard_names(layer_name)
        if any(n not in self.tensors for n in names) or not native.available():
            return None
        types = [self.tensors[n][0] for n in names]
        in_features = self.tensors[names[0]][1][1]
        if any(t not in NATIVE_TYPES or in_features % block_shape(t)[0] for t in types):
            return None
        self._raw.update(names)
        return GGUFBlockMethod(types[0] if len(set(types)) == 1 else types)

    def keeps_raw(self, hf_name: str) -> bool:
        """True when the loader should hand this tensor over as GGUFBlocks (ask after
        the model is built: the plan learns its layers from the factory calls)."""
        return hf_name in self._raw
