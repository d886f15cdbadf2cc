"""Vocabulary-parallel embedding and lm_head: rank r holds rows [r * V', (r + 1) * V') of the
[vocab, hidden] table (V' = ceil(V / T), zero rows past V on the last rank).

    lookup  ids outside the rank's range read row 0 and are zeroed; the all-reduce sums the
            one rank that holds each id with zeros from the others
    logits  each rank's [n, V'] part, gathered onto the sampling rank in rank order
"""
from __future__ import annotations

import torch

from treadle.distributed.parallel import ParallelContext
from treadle.layers.linear import Linear


def vocab_embedding(layer: Linear, ids: torch.Tensor, dtype: torch.dtype, ctx: ParallelContext) -> torch.Tensor:
    """ids [n] -> [n, hidden] rows of the full table."""
    if ctx.tp_size == 1:
        return layer.method.embedding(layer, ids, dtype)
    rows = layer.out_features
    local = ids - ctx.tp_rank * rows
    inside = (local >= 0) & (local < rows)
    x = layer.method.embedding(layer, torch.where(inside, local, torch.zeros_like(local)), dtype)
    x = x.masked_fill(~inside.unsqueeze(-1), 0.0)
    return ctx.all_reduce(x)


def vocab_logits(head: Linear, hidden: torch.Tensor, ctx: ParallelContext) -> torch.Tensor | None:
    """hidden [n, hidden] -> [n, vocab] float32 on the sampling rank, None on other ranks."""
    return ctx.gather_logits(head(hidden).float())
