"""GGUF Q4_0 / Q4_1 / Q8_0 weights kept quantized, mapped onto torch's packed int4 kernel.

GGUF stores each row as blocks of 32 inputs (little-endian, ``d``/``m`` float16)::

    Q4_0 (18 B): d | qs[16]          w = d * (q - 8)     q[j] = qs[j] & 15, q[j+16] = qs[j] >> 4
    Q4_1 (20 B): d | m | qs[16]      w = d * q + m       (same nibble order)
    Q8_0 (34 B): d | qs[32] (int8)   w = d * q

The int4 kernel computes ``(q - 8) * scale + zero`` per group of 32, so the integers
carry over unchanged and only the per-block constants are rewritten::

    Q4_0:  scale = d, zero = 0
    Q4_1:  scale = d, zero = m + 8 d
    Q8_0:  q = 16 hi + lo (hi = q >> 4 in -8..7, lo = q & 15): two int4 matmuls,
           hi: q' = hi + 8, scale = 16 d, zero = 0;   lo: q' = lo, scale = d, zero = 8 d

The kernel runs with bfloat16 scales, so results equal the dequantized reference up
to bfloat16 rounding of ``d`` and ``m`` (and of the activations).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from treadle.layers.linear import Linear, LinearMethod
from treadle.quantization.int4pack import int4_mm, int4_supported, pack_int4, scale_zeros
from treadle.quantization.weight_only import Int4WeightOnlyMethod, _check_shape, _staging_weight, shard_rows

BLOCK = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


class GGUFBlocks(NamedTuple):
    """Raw quantized rows straight from a GGUF file, rows already in HF order."""

    qtype: str  # "Q4_0" | "Q4_1" | "Q8_0"
    data: torch.Tensor  # [rows, in_features / 32 * block_bytes] uint8
    shape: tuple[int, int]  # [out_features, in_features]


def _blocks(b: GGUFBlocks) -> torch.Tensor:  # [rows, in / 32, block_bytes] uint8
    rows, cols = b.shape
    return b.data.reshape(rows, cols // BLOCK, BLOCK_BYTES[b.qtype])


def _half(raw: torch.Tensor) -> torch.Tensor:  # [..., 2] uint8 -> [...] float32
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:  # [..., 16] uint8 -> [..., 32] uint8 in 0..15
    return torch.cat((qs & 15, qs >> 4), dim=-1)


def q4_to_int4(b: GGUFBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0/Q4_1 -> (q [rows, in] 0..15, scale, zero [rows, in/32] float32)."""
    blk = _blocks(b)
    d = _half(blk[..., 0:2])
    if b.qtype == "Q4_0":
        q, zero = _nibbles(blk[..., 2:18]), torch.zeros_like(d)
    else:
        q, zero = _nibbles(blk[..., 4:20]), _half(blk[..., 2:4]) + 8 * d
    return q.reshape(b.shape), d, zero


def q8_to_int8(b: GGUFBlocks) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 -> (q [rows, in] int8, d [rows, in/32] float32)."""
    blk = _blocks(b)
    return blk[..., 2:34].contiguous().view(torch.int8).reshape(b.shape), _half(blk[..., 0:2])


def dequantize_blocks(b: GGUFBlocks) -> torch.Tensor:  # [rows, in] float32, the exact reference
    if b.qtype == "Q8_0":
        q, d = q8_to_int8(b)
        return q.float() * d.repeat_interleave(BLOCK, 1)
    q, d, zero = q4_to_int4(b)
    return (q.float() - 8) * d.repeat_interleave(BLOCK, 1) + zero.repeat_interleave(BLOCK, 1)


class GGUFQ4Method(Int4WeightOnlyMethod):
    """Q4_0/Q4_1 blocks onto the int4 kernel, group size 32 (float shards are quantized)."""

    def __init__(self) -> None:
        super().__init__(BLOCK)

    def shard_shape(self, tensor: torch.Tensor | GGUFBlocks) -> tuple[int, ...]:
        return tensor.shape if isinstance(tensor, GGUFBlocks) else tuple(tensor.shape)

    def to_int4(self, tensor: torch.Tensor | GGUFBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if isinstance(tensor, GGUFBlocks):
            return q4_to_int4(tensor)
        return super().to_int4(tensor)


class GGUFQ8Method(LinearMethod):
    """Q8_0 blocks as the sum of two int4 matmuls over the high and low nibbles."""

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        _staging_weight(layer, torch.int8, lambda p, t, s=None: self.load_shard(layer, t, s))
        layer.register_buffer("weight_scale", torch.empty(layer.out_features, layer.in_features // BLOCK))

    def load_shard(self, layer: Linear, blocks: GGUFBlocks, shard: int | None) -> None:
        start, rows = shard_rows(layer, shard)
        _check_shape(layer, rows, blocks.shape)
        q, d = q8_to_int8(blocks)
        layer.weight.data[start : start + rows] = q
        layer.weight_scale[start : start + rows] = d

    def process_weights_after_loading(self, layer: Linear) -> None:
        q, d = layer.weight.data, layer.weight_scale
        layer.weight = nn.Parameter(pack_int4((q >> 4) + 8), requires_grad=False)  # high nibbles
        layer.register_buffer("weight_lo", pack_int4(q & 15))
        layer.register_buffer("weight_scale_zeros", scale_zeros(16 * d, torch.zeros_like(d)))
        layer.register_buffer("weight_lo_scale_zeros", scale_zeros(d, 8 * d))
        del layer.weight_scale

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        y = int4_mm(x, layer.weight, BLOCK, layer.weight_scale_zeros)
        y = y + int4_mm(x, layer.weight_lo, BLOCK, layer.weight_lo_scale_zeros)
        return y if layer.bias is None else y + layer.bias


_FUSED = {".qkv_proj": (".q_proj", ".k_proj", ".v_proj"), ".gate_up_proj": (".gate_proj", ".up_proj")}


class GGUFNativePlan:
    """Which linear layers of a GGUF model stay quantized, decided from the file's tensor
    types: a layer whose shards are all Q4_0/Q4_1 (or all Q8_0) and whose shape the
    kernel accepts; anything else (and lm_head) is dequantized at load as before."""

    def __init__(self, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> None:
        self.tensors = tensors  # HF weight name -> (GGUF type name, HF shape)
        self._raw: set[str] = set()

    def shard_names(self, layer_name: str) -> list[str]:
        for fused, parts in _FUSED.items():
            if layer_name.endswith(fused):
                stem = layer_name.removesuffix(fused)
                return [f"{stem}{p}.weight" for p in parts]
        return [f"{layer_name}.weight"]

    def method(self, layer_name: str) -> LinearMethod | None:
        """The factory handed to the model: ``Callable[[str], LinearMethod | None]``."""
        names = self.shard_names(layer_name)
        if layer_name == "lm_head" or any(n not in self.tensors for n in names):
            return None
        types = {self.tensors[n][0] for n in names}
        out = sum(self.tensors[n][1][0] for n in names)
        in_features = self.tensors[names[0]][1][1]
        if not int4_supported(out, in_features, BLOCK):
            return None
        if types <= {"Q4_0", "Q4_1"}:
            self._raw.update(names)
            return GGUFQ4Method()
        if types == {"Q8_0"}:
            self._raw.update(names)
            return GGUFQ8Method()
        return None

    def keeps_raw(self, hf_name: str) -> bool:
        """True when the loader should hand this tensor over as GGUFBlocks (ask after
        the model is built: the plan learns its layers from the factory calls)."""
        return hf_name in self._raw
