"""AWQ checkpoints (AutoAWQ, ``quant_method: awq``, ``version: gemm``), 4-bit with zero points.
Per linear module (N outputs, K inputs, G the group size)::

    qweight  int32 [K, N / 8]        8 outputs per word, interleaved: nibble i (bits 4i) of
                                     word j holds output column 8j + ORDER[i],
                                     ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
    qzeros   int32 [K / G, N / 8]    the same packing
    scales   float16 [K / G, N]

    w[n, k] = (q[k, n] - z[k // G, n]) * scales[k // G, n]

Decoded into Int4Weight and run as Q4_1 blocks (int4_checkpoint.py). Other versions (gemv,
marlin, exllama) and zero_point false are a one-line error.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from treadle.config import TreadleError
from treadle.quantization.formats.checkpoint import FLOAT, CheckpointQuantization, LayerFormat, Shape
from treadle.quantization.formats.int4 import Int4Format, Int4Weight, unpack_nibbles

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column ORDER[i] of its 8


def _columns(words: torch.Tensor) -> torch.Tensor:
    """[a, N / 8] int32 -> [a, N] uint8 in column order."""
    nibbles = unpack_nibbles(words, dim=1).view(words.shape[0], -1, 8)  # [a, N/8, nibble]
    inverse = torch.tensor([ORDER.index(c) for c in range(8)])
    return nibbles[..., inverse].reshape(words.shape[0], -1)


@dataclass(frozen=True)
class AWQInt4(Int4Format):
    group_size: int

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"awq gemm int4 group_size {self.group_size}"

    def tensors(self, rows: int, in_features: int) -> dict[str, tuple[Shape, str]]:
        if in_features % self.group_size or rows % 8:
            raise TreadleError(f"{self.name}: a {rows}x{in_features} layer does not divide into groups and words")
        groups = in_features // self.group_size
        return {"qweight": ((in_features, rows // 8), "I32"), "qzeros": ((groups, rows // 8), "I32"),
                "scales": ((groups, rows), FLOAT)}

    def decode(self, tensors: dict[str, torch.Tensor], rows: int, in_features: int) -> Int4Weight:
        q = _columns(tensors["qweight"]).t().contiguous()  # [N, K]
        zero = _columns(tensors["qzeros"]).t().float()  # [N, groups]
        group = torch.arange(in_features) // self.group_size
        return Int4Weight(q, tensors["scales"].float().t().contiguous(), zero, group)


class AWQQuantization(CheckpointQuantization):
    """Every decoder-layer linear not in ``modules_to_not_convert``; lm_head stays float."""

    method = "awq"

    def __init__(self, fmt: AWQInt4, skip: tuple[str, ...]) -> None:
        self.fmt, self.skip = fmt, skip

    @staticmethod
    def from_config(raw: dict[str, Any]) -> AWQQuantization:
        bits = raw.get("bits", raw.get("w_bit"))
        group = raw.get("group_size", raw.get("q_group_size"))
        version, zero_point = str(raw.get("version", "gemm")).lower(), raw.get("zero_point", True)
        if bits != 4 or group not in (32, 64, 128) or version != "gemm" or not zero_point:
            raise TreadleError(f"awq bits={bits} group_size={group} version={version} zero_point={zero_point} is "
                               "not supported (supported: bits 4, group_size 32/64/128, version gemm, zero_point)")
        return AWQQuantization(AWQInt4(int(group)), tuple(raw.get("modules_to_not_convert") or ()))

    def formats(self) -> list[LayerFormat]:
        return [self.fmt]

    def format_for(self, module: str) -> LayerFormat | None:
        if ".layers." not in module or any(s in module for s in self.skip):
            return None
        return self.fmt
