"""Linear layers whose weights are created, loaded and applied by a per-layer
quantization method chosen at load time (GUIDE principle 6).

A layer may fuse several logical projections (q/k/v, gate/up): ``output_sizes``
lists them and ``weight_loader(param, tensor, shard)`` places each one's rows.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn


class LinearMethod(ABC):
    """How a linear layer stores and multiplies its weight."""

    @abstractmethod
    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        """Register the layer's parameters, each with a ``weight_loader`` attribute."""

    def process_weights_after_loading(self, layer: Linear) -> None:  # noqa: B027 (optional hook)
        """Repack loaded weights into the form ``apply`` uses (default: nothing)."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features] (bias included)."""

    def embedding(self, layer: Linear, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of the weight, for a layer that is also a vocabulary embedding."""
        return F.embedding(ids, layer.weight).to(dtype)


def load_rows(layer: Linear, param: torch.Tensor, loaded: torch.Tensor, shard: int | None) -> None:
    """Copy ``loaded`` into the row block of ``param`` that belongs to ``shard``."""
    if shard is None:
        target = param.data
    else:
        start = sum(layer.output_sizes[:shard])
        target = param.data.narrow(0, start, layer.output_sizes[shard])
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(f"shape mismatch: expected {tuple(target.shape)}, got {tuple(loaded.shape)}")
    target.copy_(loaded)


class UnquantizedLinearMethod(LinearMethod):
    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        weight = nn.Parameter(
            torch.empty(layer.out_features, layer.in_features, dtype=dtype), requires_grad=False
        )
        weight.weight_loader = lambda p, t, s=None: load_rows(layer, p, t, s)  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


class Linear(nn.Module):
    # registered by ``method.create_weights`` / below; declared so readers get tensors
    weight: torch.Tensor
    bias: torch.Tensor | None
    method: LinearMethod

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool,
        dtype: torch.dtype,
        method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(output_sizes)
        self.method = method or UnquantizedLinearMethod()
        self.method.create_weights(self, dtype)
        if bias:
            b = nn.Parameter(torch.zeros(self.out_features, dtype=dtype), requires_grad=False)
            b.weight_loader = lambda p, t, s=None: load_rows(self, p, t, s)  # type: ignore[attr-defined]
            self.bias = b
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)
