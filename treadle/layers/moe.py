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

A rank may hold a part of the experts: ``experts`` (a range of expert ids, expert
parallelism) and/or ``columns`` (a range of every expert's intermediate columns, tensor
parallelism without expert parallelism). Either way its output is a partial sum the caller
all-reduces.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

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
    this rank's part (``treadle.models.layout.ExpertsLayout`` names the shards)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 experts: range | None = None, columns: range | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.experts = experts if experts is not None else range(num_experts)
        self.columns = columns if columns is not None else range(intermediate_size)
        n, cols = len(self.experts), len(self.columns)
        self.w13 = nn.Parameter(torch.empty(n, 2 * cols, hidden_size, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(n, hidden_size, cols, dtype=dtype), requires_grad=False)
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
        rows = tensor.narrow(0, self.columns.start, cols)
        _copy(param.data[local, part * cols : (part + 1) * cols], rows, shard)

    def _load_w2(self, param: torch.Tensor, tensor: torch.Tensor, shard: int | None) -> None:
        """shard e: expert e's down [hidden, I]."""
        assert shard is not None
        local = self._local(shard)
        if local is not None:
            _copy(param.data[local], tensor.narrow(1, self.columns.start, len(self.columns)), shard)

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
        out = torch.empty_like(xs)
        start = 0
        for local, expert in enumerate(self.experts):
            n = counts[expert]
            if n:
                h = silu_and_mul(torch.mm(xs[start : start + n], self.w13[local].t()))
                torch.mm(h, self.w2[local].t(), out=out[start : start + n])
                start += n
        out.mul_(routing.weights.reshape(-1).index_select(0, mine).unsqueeze(1).to(out.dtype))
        return torch.zeros_like(x).index_add_(0, tokens, out)


def _copy(target: torch.Tensor, loaded: torch.Tensor, shard: int) -> None:
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(f"expert shard {shard}: expected shape {tuple(target.shape)}, got {tuple(loaded.shape)}")
    target.copy_(loaded)
