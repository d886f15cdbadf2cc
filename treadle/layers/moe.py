"""Mixture of experts: the router's top-k and the fused expert MLPs of one sparse layer.

Every token goes to ``top_k`` of E SwiGLU experts. Instead of a loop over tokens, the step's
(token, expert) assignments are sorted by expert id, so each expert's tokens are one
contiguous group and each expert runs one batched matmul over all its tokens::

    ids [T, k]  --flatten, stable argsort-->  order [T*k]    (assignments grouped by expert)
    x[order // k]      = [ e0's tokens | e1's tokens | (e2: none) | e3's tokens ... ]
                            w13[0], w2[0]   w13[1], w2[1]            w13[3], w2[3]
    out[group] * weight  --index_add over token ids-->  y [T, hidden]

Per token, the contributions are added in increasing expert order, whatever else is in the
batch (the order transformers' reference loop adds them in too). Experts with no tokens cost
nothing; the Python loop is over experts that have tokens, never over tokens.

The experts are float (two stacked tensors) or, given ``block_types``, GGUF blocks (a GGUF
file's quantized experts kept as stored, or a float checkpoint's quantized at load, as
``--quantization int8`` does) multiplied by the C ``qmatmul`` kernel, one call per expert group.

A rank may hold a part of the experts: ``experts`` (a range of expert ids, expert
parallelism) and/or ``columns`` (a range of every expert's intermediate columns, tensor
parallelism without expert parallelism). Either way its output is a partial sum the caller
all-reduces.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize
from torch import nn

from treadle.kernels import native
from treadle.layers.activation import silu_and_mul


class Routing(NamedTuple):
    weights: torch.Tensor  # [num_tokens, top_k] float32, each token's experts' mixing weights
    ids: torch.Tensor  # [num_tokens, top_k] int64 expert ids


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """Softmax over all experts (in float32), keep the top k, and renormalize them to sum 1
    when ``renormalize`` (Mixtral always; Qwen MoE when ``norm_topk_prob``). Mixtral's
    "softmax over the top-k logits" is the same weights."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights, ids)


class FusedMoE(nn.Module):
    """The routed experts of one layer, stacked: w13 [E_local, 2 * I_local, hidden] (each
    expert's gate rows then up rows) and w2 [E_local, hidden, I_local].

    ``experts``: the expert ids this rank holds (all of them without expert parallelism);
    ``columns``: the intermediate columns of each expert it holds (all of them under expert
    parallelism). The weight loaders take the checkpoint's whole per-expert tensors and keep
    this rank's part (``treadle.models.layout.ExpertsLayout`` names the shards).

    ``block_types`` (gate, up, down GGUF type names): w13 and w2 are instead uint8 [E_local,
    bytes], each expert's gate rows, up rows (and down rows) of blocks back to back."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 experts: range | None = None, columns: range | None = None,
                 block_types: tuple[str, str, str] | None = None) -> None:
        super().__init__()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.experts = experts if experts is not None else range(num_experts)
        self.columns = columns if columns is not None else range(intermediate_size)
        self.block_types = block_types
        n, cols = len(self.experts), len(self.columns)
        if block_types is None:
            self.w13 = nn.Parameter(torch.empty(n, 2 * cols, hidden_size, dtype=dtype), requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(n, hidden_size, cols, dtype=dtype), requires_grad=False)
        else:
            gate, up, down = block_types
            self.segments13: native.Segments = ((gate, 2 * cols),) if gate == up else ((gate, cols), (up, cols))
            self.segments2: native.Segments = ((down, hidden_size),)
            nbytes13 = cols * (_row_bytes(gate, hidden_size) + _row_bytes(up, hidden_size))
            self.w13 = nn.Parameter(torch.empty(n, nbytes13, dtype=torch.uint8), requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(n, hidden_size * _row_bytes(down, cols), dtype=torch.uint8),
                                   requires_grad=False)
        self.w13.weight_loader = self._load_w13  # type: ignore[attr-defined]
        self.w2.weight_loader = self._load_w2  # type: ignore[attr-defined]

    # -- loading ------------------------------------------------------------------------
    def _local(self, expert: int) -> int | None:
        return expert - self.experts.start if expert in self.experts else None

    def _load_w13(self, param: torch.Tensor, tensor: torch.Tensor, shard: int | None) -> None:
        """shard 2e: expert e's gate [I, hidden]; 2e + 1: its up."""
        assert shard is not None
        expert, part = divmod(shard, 2)
        local = self._local(expert)
        if local is None:
            return  # another rank's expert
        cols = len(self.columns)
        if self.block_types is not None:
            qtype, gate = self.block_types[part], self.block_types[0]
            data = _blocks(tensor, qtype, shard)[self.columns.start : self.columns.stop].reshape(-1)
            start = part * cols * _row_bytes(gate, self.hidden_size)
            _copy(param.data[local, start : start + data.numel()], data, shard)
            return
        rows = _float(tensor).narrow(0, self.columns.start, cols)
        _copy(param.data[local, part * cols : (part + 1) * cols], rows, shard)

    def _load_w2(self, param: torch.Tensor, tensor: torch.Tensor, shard: int | None) -> None:
        """shard e: expert e's down [hidden, I]."""
        assert shard is not None
        local = self._local(shard)
        if local is not None and self.block_types is not None:
            data = _blocks(tensor, self.block_types[2], shard)
            inputs, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[self.block_types[2]]]
            part = data[:, self.columns.start // inputs * nbytes : self.columns.stop // inputs * nbytes]
            _copy(param.data[local], part.reshape(-1), shard)
        elif local is not None:
            _copy(param.data[local], _float(tensor).narrow(1, self.columns.start, len(self.columns)), shard)

    # -- compute ------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x [T, hidden], routing of each token -> [T, hidden]: the sum over this rank's
        experts (and columns) of weight * expert(x); zero rows for tokens it has none of."""
        num_tokens, top_k = routing.ids.shape
        flat = routing.ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # [T*k] assignments grouped by expert id
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        first = sum(counts[: self.experts.start])  # this rank's experts are one run of the order
        mine = order[first : first + sum(counts[self.experts.start : self.experts.stop])]
        tokens = mine // top_k  # [n] token of each assignment
        xs = x.index_select(0, tokens)
        if x.is_cuda and self.block_types is None:
            out = self._grouped_triton(xs, counts)
        else:
            out = self._per_expert(xs, counts)
        out.mul_(routing.weights.reshape(-1).index_select(0, mine).unsqueeze(1).to(out.dtype))
        return torch.zeros_like(x).index_add_(0, tokens, out)

    def _grouped_triton(self, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every expert's group in one Triton launch per matmul (``treadle.layers.moe_triton``)."""
        from treadle.layers import moe_triton

        tiles = moe_triton.expert_tiles(counts, self.experts, xs.device)
        h = silu_and_mul(moe_triton.grouped_matmul(xs, self.w13, tiles))
        return moe_triton.grouped_matmul(h, self.w2, tiles)

    def _per_expert(self, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """One matmul pair per expert that has rows (torch, or the C kernels for blocks)."""
        out = torch.empty_like(xs)
        start = 0
        for local, expert in enumerate(self.experts):
            n = counts[expert]
            if n and self.block_types is not None:
                h = silu_and_mul(native.qmatmul(self.segments13, self.w13[local], xs[start : start + n]))
                out[start : start + n] = native.qmatmul(self.segments2, self.w2[local], h)
            elif n:
                h = silu_and_mul(torch.mm(xs[start : start + n], self.w13[local].t()))
                torch.mm(h, self.w2[local].t(), out=out[start : start + n])
            start += n
        return out


def block_inputs(qtype: str) -> int:
    """Inputs per block of GGUF type ``qtype`` (32 or 256)."""
    return int(GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][0])


def _row_bytes(qtype: str, inputs: int) -> int:
    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    return inputs // block * block_bytes


def _blocks(tensor: Any, qtype: str, shard: int) -> torch.Tensor:
    """A checkpoint tensor as ``qtype`` blocks [rows, row bytes]: GGUF blocks as read, or a float
    tensor quantized with the gguf package's quantizer."""
    if hasattr(tensor, "qtype"):
        if tensor.qtype != qtype:
            raise ValueError(f"expert shard {shard}: expected {qtype} blocks, got {tensor.qtype}")
        return tensor.data
    array = quantize(tensor.float().numpy(), GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(array))


def _float(tensor: Any) -> torch.Tensor:
    """GGUF blocks dequantized (experts whose blocks do not fit this rank's widths), else as is."""
    if not hasattr(tensor, "qtype"):
        return tensor
    return torch.from_numpy(dequantize(tensor.data.numpy(), GGMLQuantizationType[tensor.qtype])).reshape(tensor.shape)


def _copy(target: torch.Tensor, loaded: torch.Tensor, shard: int) -> None:
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(f"expert shard {shard}: expected shape {tuple(target.shape)}, got {tuple(loaded.shape)}")
    target.copy_(loaded)
