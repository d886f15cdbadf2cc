"""Communication hidden behind computation under tensor parallelism: a step's tokens are cut
into two micro-batches that go through the layers in lockstep, each phase's all-reduce of one
micro-batch running asynchronously while the other computes::

    layer i   attn(A) -> all_reduce(A) ..........
              attn(B) -> all_reduce(B) .......  :      (A's reduce runs during attn(B))
              wait(A), mlp(A) -> all_reduce(A) ..:...
              wait(B), mlp(B) -> all_reduce(B)   :  :  (B's reduce runs during mlp(A))
    layer i+1 wait(A), attn(A) ...

Micro-batch A is the first half of the step's tokens in order, so when one request's chunk
is cut in two, A's keys and values are in the cache (written by A's attention of the same
layer) before B's attention reads them.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from treadle.distributed.parallel import ParallelContext

# (micro-batch index, x, residual) -> (partial output to all-reduce, residual)
Phase = Callable[[int, torch.Tensor, "torch.Tensor | None"], tuple[torch.Tensor, torch.Tensor]]


class TokenSplit(NamedTuple):
    """One micro-batch's part of the step, in the StepInputBuilder's terms."""

    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[Sequence[int]]


def split_tokens(query_lens: list[int], seq_lens: list[int], block_tables: Sequence[Sequence[int]],
                 at: int) -> tuple[TokenSplit, TokenSplit]:
    """The step's first ``at`` tokens and the rest; a request whose chunk straddles ``at`` is
    in both (its first tokens in A, ending ``seq_len - rest`` in, the rest in B)."""
    a, b = TokenSplit([], [], []), TokenSplit([], [], [])
    cursor = 0
    for q, s, table in zip(query_lens, seq_lens, block_tables, strict=True):
        in_a = min(q, max(0, at - cursor))
        if in_a:
            a.query_lens.append(in_a)
            a.seq_lens.append(s - q + in_a)
            a.block_tables.append(table)
        if q - in_a:
            b.query_lens.append(q - in_a)
            b.seq_lens.append(s)
            b.block_tables.append(table)
        cursor += q
    return a, b


def run_overlapped(phases: Sequence[Phase], xs: list[torch.Tensor],
                   ctx: ParallelContext) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run every phase on every micro-batch (phase-major, micro-batches in turn), each phase's
    output all-reduced asynchronously and waited for only when that micro-batch needs it next.
    ``xs``: each micro-batch's input to the first phase; returns its (x, residual) after the last."""
    n = len(xs)
    residuals: list[torch.Tensor | None] = [None] * n
    pending: list[Any] = [None] * n
    for phase in phases:
        for m in range(n):
            if pending[m] is not None:
                pending[m].wait()
            xs[m], residuals[m] = phase(m, xs[m], residuals[m])
            pending[m] = ctx.all_reduce_async(xs[m])
    out = []
    for m in range(n):
        pending[m].wait()
        residual = residuals[m]
        assert residual is not None
        out.append((xs[m], residual))
    return out
