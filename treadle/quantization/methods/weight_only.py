"""Weight-only int8 (per output channel) and int4 (per group of inputs) linear methods.

Each shard is quantized as it arrives (so a float checkpoint never sits in memory at
full size next to its quantized copy) into staging storage: ``weight`` holds one
integer per element ([out, in], uint8 or int8), scales/zeros sit beside it. After
loading, int4 values are packed two per byte for torch's kernel.
"""
from __future__ import annotations

import torch
from torch import nn

from treadle.layers.linear import Linear, LinearMethod, UnquantizedLinearMethod
from treadle.quantization.methods.int4pack import (
    int4_mm,
    int4_supported,
    int8_mm,
    pack_int4,
    quantize_int4,
    quantize_int8,
    scale_zeros,
)


def shard_rows(layer: Linear, shard: int | None) -> tuple[int, int]:
    """(first row, row count) of ``shard`` in the layer's fused output."""
    if shard is None:
        return 0, layer.out_features
    return sum(layer.output_sizes[:shard]), layer.output_sizes[shard]


def _check_shape(layer: Linear, rows: int, shape: tuple[int, ...]) -> None:
    if tuple(shape) != (rows, layer.in_features):
        raise ValueError(f"shape mismatch: expected {(rows, layer.in_features)}, got {tuple(shape)}")


def _buffer(layer: Linear, name: str) -> torch.Tensor:
    """One of the buffers this module's methods register on ``layer`` (scales, zeros)."""
    buf: torch.Tensor = getattr(layer, name)  # plain attribute lookup: this sits on the matmul path
    return buf


def _staging_weight(layer: Linear, dtype: torch.dtype, loader) -> None:  # noqa: ANN001
    weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=dtype), requires_grad=False)
    weight.weight_loader = loader  # type: ignore[attr-defined]
    layer.register_parameter("weight", weight)


class Int8WeightOnlyMethod(LinearMethod):
    """int8 weights, one bfloat16 scale per output row."""

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        _staging_weight(layer, torch.int8, lambda p, t, s=None: self.load_shard(layer, t, s))
        layer.register_buffer("weight_scale", torch.empty(layer.out_features))  # [out] f32 while loading

    def load_shard(self, layer: Linear, tensor: torch.Tensor, shard: int | None) -> None:
        start, rows = shard_rows(layer, shard)
        _check_shape(layer, rows, tuple(tensor.shape))
        q, scale = quantize_int8(tensor)
        layer.weight.data[start : start + rows] = q
        _buffer(layer, "weight_scale")[start : start + rows] = scale

    def process_weights_after_loading(self, layer: Linear) -> None:
        layer.weight_scale = _buffer(layer, "weight_scale").to(torch.bfloat16)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        y = int8_mm(x, layer.weight, _buffer(layer, "weight_scale"))
        return y if layer.bias is None else y + layer.bias


class Int4WeightOnlyMethod(LinearMethod):
    """int4 weights in groups of ``group_size`` inputs, a bfloat16 scale and zero per group."""

    def __init__(self, group_size: int = 32) -> None:
        if group_size not in (32, 64, 128):
            raise ValueError(f"int4 group size must be 32, 64 or 128, not {group_size}")
        self.group_size = group_size
        self.fallback: UnquantizedLinearMethod | None = None

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        if not int4_supported(layer.out_features, layer.in_features, self.group_size):
            self.fallback = UnquantizedLinearMethod()  # a shape the kernel cannot take stays float
            self.fallback.create_weights(layer, dtype)
            return
        _staging_weight(layer, torch.uint8, lambda p, t, s=None: self.load_shard(layer, t, s))
        groups = layer.in_features // self.group_size
        layer.register_buffer("weight_scale", torch.empty(layer.out_features, groups))  # [out, in/G]
        layer.register_buffer("weight_zero", torch.empty(layer.out_features, groups))  # [out, in/G]

    def to_int4(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A loaded shard -> (q [rows, in] 0..15, scale, zero [rows, in/G])."""
        return quantize_int4(tensor, self.group_size)

    def shard_shape(self, tensor: torch.Tensor) -> tuple[int, ...]:
        return tuple(tensor.shape)

    def load_shard(self, layer: Linear, tensor: torch.Tensor, shard: int | None) -> None:
        start, rows = shard_rows(layer, shard)
        _check_shape(layer, rows, self.shard_shape(tensor))
        q, scale, zero = self.to_int4(tensor)
        layer.weight.data[start : start + rows] = q
        _buffer(layer, "weight_scale")[start : start + rows] = scale
        _buffer(layer, "weight_zero")[start : start + rows] = zero

    def process_weights_after_loading(self, layer: Linear) -> None:
        if self.fallback is not None:
            return
        packed = pack_int4(layer.weight.data)  # [out, in/2] uint8
        layer.weight = nn.Parameter(packed, requires_grad=False)
        layer.register_buffer("weight_scale_zeros", scale_zeros(_buffer(layer, "weight_scale"), _buffer(layer, "weight_zero")))
        del layer.weight_scale, layer.weight_zero

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.fallback is not None:
            return self.fallback.apply(layer, x)
        y = int4_mm(x, layer.weight, self.group_size, _buffer(layer, "weight_scale_zeros"))
        return y if layer.bias is None else y + layer.bias
