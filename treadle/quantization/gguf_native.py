"""GGUF Q4_0 / Q4_1 / Q8_0 weights kept quantized in memory and multiplied by
Treadle's C kernels (``treadle/kernels/csrc/qmatmul.c``), which dequantize on the fly.

GGUF stores each row as blocks of 32 inputs (little-endian, ``d``/``m`` float16)::

    Q4_0 (18 B): d | qs[16]          w = d * (q - 8)     q[j] = qs[j] & 15, q[j+16] = qs[j] >> 4
    Q4_1 (20 B): d | m | qs[16]      w = d * q + m       (same nibble order)
    Q8_0 (34 B): d | qs[32] (int8)   w = d * q

A layer keeps its rows exactly as the file has them (fused q/k/v or gate/up shards are
stacked row-wise), so resident memory is the file's size. Activations stay float32:
results equal the dequantized reference up to float32 summation order. The same
method serves the embedding (rows gathered and dequantized) and a tied or quantized
lm_head (a matmul over the same bytes).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from treadle.kernels import native
from treadle.layers.linear import Linear, LinearMethod
from treadle.quantization.weight_only import shard_rows

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


def dequantize_blocks(b: GGUFBlocks) -> torch.Tensor:  # [rows, in] float32
    """The blocks' exact values in plain torch (the reference the kernels are tested against)."""
    blk = _blocks(b)
    d = _half(blk[..., 0:2]).unsqueeze(-1)
    if b.qtype == "Q8_0":
        return (blk[..., 2:34].contiguous().view(torch.int8).float() * d).reshape(b.shape)
    qs = blk[..., 4:20] if b.qtype == "Q4_1" else blk[..., 2:18]
    q = torch.cat((qs & 15, qs >> 4), dim=-1).float()  # element j in the low nibble, j + 16 in the high
    m = _half(blk[..., 2:4]).unsqueeze(-1) if b.qtype == "Q4_1" else -8 * d
    return (d * q + m).reshape(b.shape)


def quantize_blocks(w: torch.Tensor, qtype: str) -> GGUFBlocks:
    """A float [rows, in] tensor as GGUF blocks (the gguf package's reference quantizer)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    data = quantize(w.detach().float().cpu().numpy(), GGMLQuantizationType[qtype])
    return GGUFBlocks(qtype, torch.from_numpy(data), (w.shape[0], w.shape[1]))


class GGUFBlockMethod(LinearMethod):
    """A layer whose weight is GGUF blocks of one type, [out_features, in/32 * block bytes] uint8.
    Shards arrive as blocks (a GGUF file) or as float tensors, quantized on arrival with the
    gguf package's own quantizer (``--quantization int8|int4`` on a float checkpoint)."""

    def __init__(self, qtype: str) -> None:
        if qtype not in BLOCK_BYTES:
            raise ValueError(f"unsupported GGUF block type {qtype!r}")
        self.qtype = qtype

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        if layer.in_features % BLOCK:
            raise ValueError(f"GGUF blocks need in_features divisible by {BLOCK}, not {layer.in_features}")
        row_bytes = layer.in_features // BLOCK * BLOCK_BYTES[self.qtype]
        weight = nn.Parameter(torch.empty(layer.out_features, row_bytes, dtype=torch.uint8), requires_grad=False)
        weight.weight_loader = lambda p, t, s=None: self.load_shard(layer, t, s)  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)

    def load_shard(self, layer: Linear, blocks: GGUFBlocks | torch.Tensor, shard: int | None) -> None:
        if isinstance(blocks, torch.Tensor) and blocks.is_floating_point():
            blocks = quantize_blocks(blocks, self.qtype)
        if not isinstance(blocks, GGUFBlocks) or blocks.qtype != self.qtype:
            got = blocks.qtype if isinstance(blocks, GGUFBlocks) else f"a {blocks.dtype} tensor"
            raise ValueError(f"expected {self.qtype} blocks, got {got}")
        start, rows = shard_rows(layer, shard)
        if tuple(blocks.shape) != (rows, layer.in_features):
            raise ValueError(f"shape mismatch: expected {(rows, layer.in_features)}, got {tuple(blocks.shape)}")
        layer.weight.data[start : start + rows] = blocks.data

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        bias = None if layer.bias is None else layer.bias.float().contiguous()
        return native.qmatmul(self.qtype, layer.weight, x, bias).to(x.dtype)

    def embedding(self, layer: Linear, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return native.gather_rows(self.qtype, layer.weight, ids, layer.in_features).to(dtype)


class GGUFNativePlan:
    """Which layers of a GGUF model stay quantized, decided from the file's tensor types:
    every linear layer, the embedding and lm_head whose shards are all one of Q4_0, Q4_1,
    Q8_0; anything else is dequantized to float at load. Without Treadle's C kernels
    (no C compiler, or ``TREADLE_NATIVE_KERNELS=0``) everything is dequantized."""

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
        types = {self.tensors[n][0] for n in names}
        if len(types) != 1 or self.tensors[names[0]][1][1] % BLOCK:
            return None
        (qtype,) = types
        if qtype not in BLOCK_BYTES:
            return None
        self._raw.update(names)
        return GGUFBlockMethod(qtype)

    def keeps_raw(self, hf_name: str) -> bool:
        """True when the loader should hand this tensor over as GGUFBlocks (ask after
        the model is built: the plan learns its layers from the factory calls)."""
        return hf_name in self._raw
