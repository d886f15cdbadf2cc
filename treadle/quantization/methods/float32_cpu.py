"""Float32 linear layers on the CPU whose rows do not depend on their batch.

torch's CPU matmul (MKL / oneDNN) picks its kernel, its blocking and its thread split from the
shape of the call, so the same input row times the same weight comes out with different last
bits at M = 1, at M = 5 or beside 99 other rows. In an engine that moves a token between steps of
different sizes (a prompt whole, in chunks, after a prefix-cache hit, recomputed after preemption)
that changes logprobs, and, where two tokens are nearly tied, greedy tokens.

``Float32TiledMethod`` multiplies every call as tiles of ``ROW_TILE`` rows, each tile in its own
buffer and the last one padded with zero rows: every matmul of a layer then has one shape, so a
row's result does not depend on the rows beside it (checked in tests/engine/test_engine_prefix_exact.py
and tests/test_float32_rows.py). Decode pays ROW_TILE rows of arithmetic for one (small against
reading the weights); prefill reads the weights once per tile. Each tile is multiplied as
W x^T (the weight as the streamed left operand): at 8 rows MKL takes 1.5-1.8x longer for
x W^T, which packs the [N, K] weight as the right operand (262144 x 640: 260 vs 143 ms; 2048 x
640: 0.85 vs 0.58 ms; SPR, one thread).

    x [M, K] --pad to a multiple of ROW_TILE--> tiles [ROW_TILE, K] --W tile^T each--> cat, cut to M (+ bias)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from treadle.layers.linear import Linear, UnquantizedLinearMethod
from treadle.quantization import MethodFactory

ROW_TILE = 8


class Float32TiledMethod(UnquantizedLinearMethod):
    """The plain float layer; on CPU float32 inputs the matmul runs in tiles of ROW_TILE rows."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if not (x.is_cpu and x.dtype is torch.float32 and layer.weight.dtype is torch.float32 and x.dim() >= 2):
            return super().apply(layer, x)
        rows = x.reshape(-1, x.shape[-1])
        m = rows.shape[0]
        tiles = []
        for start in range(0, m, ROW_TILE):
            tile = rows.new_zeros(ROW_TILE, rows.shape[1])  # its own buffer: one alignment for every tile
            tile[: min(ROW_TILE, m - start)] = rows[start : start + ROW_TILE]
            tiles.append(torch.mm(layer.weight, tile.T).T)  # W x^T: 1.5-1.8x F.linear's x W^T here
        if not tiles:
            return F.linear(x, layer.weight, layer.bias)
        out = torch.cat(tiles)[:m]
        if layer.bias is not None:
            out = out + layer.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


def float32_cpu_factory(inner: MethodFactory | None, dtype: torch.dtype,
                        device: str | torch.device) -> MethodFactory | None:
    """``inner`` with the float layers it leaves to the plain method on Float32TiledMethod, for a
    float32 model on the CPU; ``inner`` unchanged otherwise."""
    if dtype is not torch.float32 or torch.device(device).type != "cpu":
        return inner
    return lambda name: (inner(name) if inner is not None else None) or Float32TiledMethod()
