"""Int4 weights read from a checkpoint (compressed-tensors pack-quantized, GPTQ, AWQ), run on
Treadle's Q4_1 block kernels.

Each format decodes a module's packed tensors into one plain form, ``Int4Weight``::

    w[n, k] = (q[n, k] - zero[n, group[k]]) * scale[n, group[k]]       q in 0..15

and that form is repacked into GGUF Q4_1 blocks (32 inputs, ``d * q + m`` with float16 d, m):
d = scale, m = -zero * scale, for every block of 32 inputs lying in one group. Group sizes 32,
64, 128 and per-channel all qualify. GPTQ's act-order (``g_idx`` not ``k // G``) is handled by
permuting the input columns at load so that groups are contiguous, and the activations by the
same permutation at run time (``PermutedInputMethod``). Exactness: d is exact for float16 or
bfloat16 scales; m is rounded to float16 unless zero is 8 (symmetric) -- relative error
< 2^-11 of the group's minimum. When a module cannot be blocked that way (no C kernels,
in_features not a multiple of 32, a group boundary inside a block, q/k/v with different
``g_idx``) its weight is dequantized to float at load instead, exactly.

The method registers one placeholder parameter per checkpoint tensor (so ``load_weights``
routes them by name), stages the shards, and after loading hands the layer over to the
runtime method chosen from the layer's device: on the CPU ``GGUFBlockMethod`` (so the fused C
decode layer takes it too), on a CUDA device ``gpu.TritonInt4Method`` (the same decoded form
packed two values per byte, a Triton dequantize-in-the-loop GEMM; any g_idx, per shard, no
permutation).
"""
from __future__ import annotations

from abc import abstractmethod
from functools import partial
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from treadle.config import TreadleError
from treadle.kernels import native
from treadle.layers.linear import Linear, LinearMethod, UnquantizedLinearMethod
from treadle.quantization.formats.checkpoint import LayerFormat
from treadle.quantization.methods.gguf_native import GGUFBlockMethod, GGUFBlocks
from treadle.quantization.methods.gpu import Kernels, PackedInt4, TritonInt4Method, kernels_for

BLOCK = 32


class Int4Weight(NamedTuple):
    """One module's int4 weight, decoded (see the module docstring for the formula)."""

    q: torch.Tensor  # [rows, K] uint8, 0..15
    scale: torch.Tensor  # [rows, groups] float32
    zero: torch.Tensor  # [rows, groups] float32 (whole numbers)
    group: torch.Tensor  # [K] int64, the group of each input

    def dequantize(self) -> torch.Tensor:  # [rows, K] float32
        return (self.q.float() - self.zero[:, self.group]) * self.scale[:, self.group]


class Int4Format(LayerFormat):
    """A LayerFormat whose weight decodes to an Int4Weight."""

    @abstractmethod
    def decode(self, tensors: dict[str, torch.Tensor], rows: int, in_features: int) -> Int4Weight:
        """The module's checkpoint tensors (by suffix, shapes already checked) -> its weight."""

    def method(self) -> LinearMethod:
        return Int4CheckpointMethod(self)


def q4_1_blocks(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """q [rows, K] 0..15 with one scale/zero per block of 32 inputs ([rows, K/32]) -> GGUF Q4_1
    rows, uint8 [rows, K/32 * 20]: per block d (f16), m (f16), then 16 bytes whose low nibbles
    are inputs 0..15 and high nibbles inputs 16..31 (csrc/qblocks.h)."""
    rows, k = q.shape
    nb = k // BLOCK
    d = scale.to(torch.float16)
    m = (-zero * scale).to(torch.float16)
    qb = q.to(torch.uint8).view(rows, nb, BLOCK)
    nibbles = qb[..., :16] | (qb[..., 16:] << 4)  # [rows, nb, 16]
    head = torch.stack((d, m), -1).view(torch.uint8).view(rows, nb, 4)
    return torch.cat((head, nibbles), -1).reshape(rows, nb * 20).contiguous()


def _block_groups(group: torch.Tensor) -> torch.Tensor | None:
    """The group of each block of 32 inputs, or None when a block straddles two groups."""
    if group.numel() % BLOCK:
        return None
    blocks = group.view(-1, BLOCK)
    return blocks[:, 0] if bool((blocks == blocks[:, :1]).all()) else None


class PermutedInputMethod(LinearMethod):
    """Runs ``inner`` on the activations' columns taken in ``perm`` order (act-order GPTQ)."""

    def __init__(self, inner: LinearMethod, perm: torch.Tensor) -> None:
        self.inner, self.perm = inner, perm  # perm: [K] int64

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        self.inner.create_weights(layer, dtype)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.inner.apply(layer, x.index_select(-1, self.perm))


class Int4CheckpointMethod(LinearMethod):
    def __init__(self, fmt: Int4Format) -> None:
        self.fmt = fmt
        self.staged: dict[tuple[str, int | None], torch.Tensor] = {}
        self.dtype = torch.float32

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        self.dtype = dtype
        for suffix in self.fmt.tensors(layer.out_features, layer.in_features):
            p = nn.Parameter(torch.empty(0), requires_grad=False)
            p.weight_loader = partial(self._stage, suffix)  # type: ignore[attr-defined]
            layer.register_parameter(suffix, p)

    def _stage(self, suffix: str, param: torch.Tensor, tensor: torch.Tensor, shard: int | None = None) -> None:
        self.staged[(suffix, shard)] = tensor

    def _decoded(self, layer: Linear) -> list[Int4Weight]:
        suffixes = list(self.fmt.tensors(layer.out_features, layer.in_features))
        shards: list[tuple[int | None, int]] = [(None, layer.out_features)]
        if (suffixes[0], None) not in self.staged:
            shards = list(enumerate(layer.output_sizes))
        out = []
        for shard, rows in shards:
            missing = [s for s in suffixes if (s, shard) not in self.staged]
            if missing:
                raise TreadleError(f"quantized layer is missing its {missing[0]} tensor (shard {shard})")
            out.append(self.fmt.decode({s: self.staged[(s, shard)] for s in suffixes}, rows, layer.in_features))
        return out

    def _device(self, layer: Linear) -> torch.device:
        """Where the layer was built (its placeholders'): the weights' device."""
        return getattr(layer, next(iter(self.fmt.tensors(layer.out_features, layer.in_features)))).device

    def process_weights_after_loading(self, layer: Linear) -> None:
        self.finish(layer, kernels_for(self._device(layer)))

    def finish(self, layer: Linear, kernels: Kernels) -> None:
        """Decode the staged tensors and install the runtime for ``kernels`` ("cpu", or "triton":
        CUDA tensors, or CPU tensors under TRITON_INTERPRET as the tests run it)."""
        parts, device = self._decoded(layer), self._device(layer)
        for suffix in self.fmt.tensors(layer.out_features, layer.in_features):
            delattr(layer, suffix)
        self.staged.clear()
        install(layer, parts, kernels, self.dtype, device)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an int4 checkpoint layer runs only after process_weights_after_loading")


def install(layer: Linear, parts: list[Int4Weight], kernels: Kernels, dtype: torch.dtype,
            device: torch.device | None = None) -> None:
    """Give ``layer`` the runtime method for its decoded weight ``parts`` (the shards of a
    fused layer, row order), its tensors on ``device`` (default: the CPU): "triton" packs them
    for the Triton GEMM (any groups), "cpu" repacks them into Q4_1 blocks, or dequantizes them
    to ``dtype`` where blocks cannot hold them (the shards' groups differ; no C kernels;
    blocks of 32 straddling two groups)."""
    device = device or torch.device("cpu")
    q = torch.cat([p.q for p in parts])
    scale, zero = torch.cat([p.scale for p in parts]), torch.cat([p.zero for p in parts])
    if kernels == "triton":
        packed = PackedInt4.pack(q, scale, zero, [p.group for p in parts], [p.q.shape[0] for p in parts])
        TritonInt4Method.attach(layer, packed.to(device))
        return
    group = parts[0].group
    same_groups = all(torch.equal(p.group, group) for p in parts)
    perm = torch.argsort(group, stable=True)
    identity = bool((perm == torch.arange(group.numel())).all())
    blocks = _block_groups(group[perm]) if same_groups else None
    if blocks is None or not native.available():
        weight = torch.cat([p.dequantize() for p in parts])
        layer.method = UnquantizedLinearMethod()
        with torch.device(device):
            layer.method.create_weights(layer, dtype)
        layer.weight.data.copy_(weight.to(dtype))
        return
    data = q4_1_blocks(q if identity else q[:, perm], scale[:, blocks], zero[:, blocks])
    runtime = GGUFBlockMethod("Q4_1")
    runtime.create_weights(layer, dtype)
    runtime.load_shard(layer, GGUFBlocks("Q4_1", data, (layer.out_features, layer.in_features)), None)
    runtime.process_weights_after_loading(layer)  # packs the rows for 8-bit activations, as a GGUF file's
    layer.method = runtime if identity else PermutedInputMethod(runtime, perm)


def unpack_nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words of 8 nibbles (nibble i at bits 4i) -> uint8 0..15, the 8 values of each word
    laid out along ``dim`` (0 or 1) in nibble order."""
    words = packed.to(torch.int32).numpy().view(np.uint32)
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    vals = ((words[..., None] >> shifts) & 0xF).astype(np.uint8)  # [a, b, 8]
    if dim == 0:
        vals = vals.transpose(0, 2, 1)  # [a, 8, b]
        return torch.from_numpy(np.ascontiguousarray(vals.reshape(-1, words.shape[1])))
    return torch.from_numpy(np.ascontiguousarray(vals.reshape(words.shape[0], -1)))
