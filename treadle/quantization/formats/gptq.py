"""GPTQ checkpoints (AutoGPTQ / GPTQModel, ``quant_method: gptq``), 4-bit. Per linear module
(N outputs, K inputs, G the group size, or K when ``group_size`` is -1)::

    qweight  int32 [K / 8, N]        8 inputs per word along the input rows: q[k, n] is
                                     bits 4 * (k % 8) of qweight[k // 8, n]
    qzeros   int32 [K / G, N / 8]    8 outputs per word along the columns: z[g, n] is
                                     bits 4 * (n % 8) of qzeros[g, n // 8]
    scales   float16 [K / G, N]
    g_idx    int32 [K]               the group of each input (``k // G`` without act-order;
                                     any order with ``desc_act``)

    w[n, k] = (q[k, n] - (z[g_idx[k], n] + 1)) * scales[g_idx[k], n]

The "+ 1" is AutoGPTQ's v1 convention (the packer stored zero - 1); ``checkpoint_format:
gptq_v2`` (GPTQModel's) stores the zero itself. Symmetric checkpoints store 7 (v1), i.e. 8.
Decoded into Int4Weight and run as Q4_1 blocks (int4_checkpoint.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from treadle.config import TreadleError
from treadle.quantization.formats.checkpoint import FLOAT, CheckpointQuantization, LayerFormat, Shape
from treadle.quantization.formats.int4 import Int4Format, Int4Weight, unpack_nibbles


@dataclass(frozen=True)
class GPTQInt4(Int4Format):
    group_size: int  # -1: one group per output channel
    v1_zeros: bool  # AutoGPTQ's stored-zero-minus-one convention

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"gptq int4 group_size {self.group_size}"

    def _group(self, in_features: int) -> int:
        g = in_features if self.group_size == -1 else self.group_size
        if in_features % g or in_features % 8:
            raise TreadleError(f"{self.name}: in_features {in_features} is not a multiple of the group size and 8")
        return g

    def tensors(self, rows: int, in_features: int) -> dict[str, tuple[Shape, str]]:
        groups = in_features // self._group(in_features)
        return {"qweight": ((in_features // 8, rows), "I32"), "qzeros": ((groups, -(-rows // 8)), "I32"),
                "scales": ((groups, rows), FLOAT), "g_idx": ((in_features,), "I32")}

    def decode(self, tensors: dict[str, torch.Tensor], rows: int, in_features: int) -> Int4Weight:
        q = unpack_nibbles(tensors["qweight"], dim=0)[:in_features].t().contiguous()  # [N, K]
        zero = unpack_nibbles(tensors["qzeros"], dim=1)[:, :rows].t().float()  # [N, groups]
        if self.v1_zeros:
            zero = zero + 1
        group = tensors["g_idx"].long()
        groups = in_features // self._group(in_features)
        if group.min() < 0 or group.max() >= groups:
            raise TreadleError(f"{self.name}: g_idx holds groups outside 0..{groups - 1}")
        return Int4Weight(q, tensors["scales"].float().t().contiguous(), zero, group)


class GPTQQuantization(CheckpointQuantization):
    """Every decoder-layer linear is quantized; lm_head and the embedding stay float."""

    method = "gptq"

    def __init__(self, fmt: GPTQInt4) -> None:
        self.fmt = fmt

    @staticmethod
    def from_config(raw: dict[str, Any]) -> GPTQQuantization:
        bits, group = raw.get("bits"), raw.get("group_size", -1)
        checkpoint_format = raw.get("checkpoint_format", "gptq")
        scheme = f"gptq bits={bits} group_size={group} checkpoint_format={checkpoint_format}"
        if bits != 4 or group not in (-1, 32, 64, 128) or checkpoint_format not in ("gptq", "gptq_v2") \
                or raw.get("lm_head", False):
            raise TreadleError(f"{scheme} is not supported (supported: bits 4, group_size -1/32/64/128, "
                               "checkpoint_format gptq or gptq_v2, lm_head not quantized)")
        return GPTQQuantization(GPTQInt4(int(group), checkpoint_format == "gptq"))

    def formats(self) -> list[LayerFormat]:
        return [self.fmt]

    def format_for(self, module: str) -> LayerFormat | None:
        return self.fmt if ".layers." in module else None
