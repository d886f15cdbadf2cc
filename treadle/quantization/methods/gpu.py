"""The GPU side of the quantized-checkpoint methods: W8A8 and W4A16 products on Triton
kernels (``triton_kernels.py``; imported here lazily, so the CPU engine never needs triton).

Which kernels a layer runs is chosen once, at load, from the device of its weights
(``kernels_for``): "triton" for CUDA tensors, "cpu" (Treadle's C kernels, or plain torch)
otherwise. The same Triton code runs on CPU tensors under ``TRITON_INTERPRET=1``, which is
how the tests check it against the torch references (tests/gpu/test_quant_gpu_kernels.py) and
``tests/gpu/test_triton_compile.py`` compiles it for sm_90. ``torch._int_mm`` is not used: its
shape rules (M > 16, K and N multiples of 8) would need a second path for decode batches.
"""
from __future__ import annotations

from types import ModuleType
from typing import Literal, NamedTuple

import torch

from treadle.config import TreadleError
from treadle.layers.linear import Linear, LinearMethod

Kernels = Literal["cpu", "triton"]
_W8A8_TILES = (64, 64, 64)  # BLOCK_M, BLOCK_N, BLOCK_K; tl.dot on int8 needs K tiles of >= 32
_W4A16_TILES = (32, 64, 32)


def kernels_for(device: torch.device) -> Kernels:
    """The kernels a layer whose weights live on ``device`` runs."""
    return "triton" if device.type == "cuda" else "cpu"


def _kernels() -> ModuleType:
    try:
        from treadle.quantization.methods import triton_kernels
    except ImportError as exc:
        raise TreadleError(f"quantized checkpoints on a GPU need triton ({exc}); pip install triton") from None
    return triton_kernels


def _block_m(m: int, largest: int) -> int:
    """Rows per tile: 16 (tl.dot's minimum) for decode-sized batches, else ``largest``."""
    return 16 if m <= 16 else largest


def w8a8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (xq [M, K] int8, xs [M] float32), ``w8a8.quantize_per_token``'s rule."""
    tk = _kernels()
    m, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    xq = torch.empty(m, k, dtype=torch.int8, device=x.device)
    xs = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        tk.w8a8_quantize_kernel[(m,)](x, xq, xs, k, x.stride(0), BLOCK_K=min(1024, _pow2(k)),
                                      enable_fp_fusion=False)
    return xq, xs


def _pow2(n: int) -> int:
    return max(16, 1 << max(0, n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _grid(m: int, n: int, tiles: tuple[int, int, int]) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """The launch grid for an [m, n] output and the tiles (BLOCK_M shrunk to fit small m)."""
    bm, bn, bk = tiles
    bm = _block_m(m, bm)
    return (_cdiv(m, bm), _cdiv(n, bn)), (bm, bn, bk)


def w8a8_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float -> [..., N] float32: x quantized per token, times int8 ``weight`` [N, K]
    (float32 ``weight_scale`` [N]) in exact int32 sums; ``w8a8.w8a8_reference``'s result."""
    tk = _kernels()
    k, n = x.shape[-1], weight.shape[0]
    xq, xs = w8a8_quantize(x.reshape(-1, k))
    m = xq.shape[0]
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    grid, (bm, bn, bk) = _grid(m, n, _W8A8_TILES)
    if m:
        tk.w8a8_matmul_kernel[grid](xq, xs, weight, weight_scale, y if bias is None else bias, y, m, n, k,
                                    HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                    enable_fp_fusion=False)
    return y.view(*x.shape[:-1], n)


class PackedInt4(NamedTuple):
    """An int4 weight as ``w4a16_matmul_kernel`` reads it (see triton_kernels.py). Output
    column n takes its inputs' groups from row ``shard[n]`` of ``group``: the shards of a fused
    layer (q/k/v of act-order GPTQ) may each have their own ``g_idx``."""

    packed: torch.Tensor  # [ceil(K / 2), N] uint8, two inputs per byte (even k in the low nibble)
    group: torch.Tensor  # [S, K] int32, the group of each input, per shard
    shard: torch.Tensor  # [N] int32, the shard (row of ``group``) of each output column
    scale: torch.Tensor  # [groups, N] float32
    mins: torch.Tensor  # [groups, N] float32, -zero * scale

    @staticmethod
    def pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, groups: list[torch.Tensor],
             rows: list[int]) -> PackedInt4:
        """From ``int4_checkpoint.Int4Weight``'s fields, the shards' rows stacked: q [N, K]
        0..15, scale and zero [N, groups]; ``groups``/``rows``: each shard's group of each
        input ([K]) and row count. w = (q - zero) * scale, rewritten q * scale + mins."""
        n, k = q.shape
        qt = q.t().to(torch.uint8)
        if k % 2:
            qt = torch.cat((qt, qt.new_zeros(1, n)))
        packed = (qt[0::2] | (qt[1::2] << 4)).contiguous()
        if all(torch.equal(g, groups[0]) for g in groups):
            groups, rows = groups[:1], [n]
        shard = torch.repeat_interleave(torch.arange(len(rows), dtype=torch.int32), torch.tensor(rows))
        return PackedInt4(packed, torch.stack(groups).to(torch.int32).contiguous(), shard,
                          scale.float().t().contiguous(), (-zero.float() * scale.float()).t().contiguous())

    def uniform_group_size(self) -> int:
        """G when input k is in group k // G in every column, G a multiple of the kernel's K
        tile (the kernel's UNIFORM path), else 0."""
        (shards, k), groups = self.group.shape, self.scale.shape[0]
        size, tile = k // groups, _W4A16_TILES[2]
        if shards > 1 or k % groups or size % tile \
                or not torch.equal(self.group[0].cpu(), torch.arange(k, dtype=torch.int32) // size):
            return 0
        return size

    def to(self, device: torch.device) -> PackedInt4:
        return PackedInt4(*(t.to(device) for t in self))

    def dequantize(self) -> torch.Tensor:  # [N, K] float32, the values the kernel multiplies by
        k = self.group.shape[1]
        q = torch.stack((self.packed & 0xF, self.packed >> 4), 1).reshape(-1, self.packed.shape[1])[:k]
        g = self.group.long()[self.shard.long()]  # [N, K]
        return q.t().float() * self.scale.t().gather(1, g) + self.mins.t().gather(1, g)


def w4a16_matmul(x: torch.Tensor, w: PackedInt4, bias: torch.Tensor | None = None, group_size: int = 0) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype: x times the int4 weight ``w``, float32 sums;
    ``group_size``: ``w.uniform_group_size()`` (0: gather each input's group)."""
    tk = _kernels()
    k, n = x.shape[-1], w.packed.shape[1]
    flat = x.reshape(-1, k)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    m = flat.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid, (bm, bn, bk) = _grid(m, n, _W4A16_TILES)
    if m:
        tk.w4a16_matmul_kernel[grid](flat, w.packed, w.group, w.shard, w.scale, w.mins, y if bias is None else bias, y,
                                     m, n, k, flat.stride(0), group_size, HAS_BIAS=bias is not None,
                                     IEEE=x.dtype == torch.float32, UNIFORM=group_size > 0,
                                     BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return y.view(*x.shape[:-1], n)


class TritonInt4Method(LinearMethod):
    """The runtime of an int4 checkpoint layer on a GPU: its ``PackedInt4`` tensors are the
    layer's buffers ``int4_packed``, ``int4_group``, ``int4_shard``... (so they move
    with the module). Installed by ``attach`` from decoded weights, never loaded directly."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size  # PackedInt4.uniform_group_size(), found once at load

    @staticmethod
    def attach(layer: Linear, weight: PackedInt4) -> None:
        """Make ``weight`` the layer's int4 weight and this method its runtime."""
        for name, t in zip(PackedInt4._fields, weight, strict=True):
            layer.register_buffer(f"int4_{name}", t)
        layer.method = TritonInt4Method(weight.uniform_group_size())

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        raise RuntimeError("TritonInt4Method holds decoded weights: install it with TritonInt4Method.attach")

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        w = PackedInt4(*(getattr(layer, f"int4_{name}") for name in PackedInt4._fields))
        return w4a16_matmul(x, w, layer.bias, self.group_size)
