"""The MoE layer's Triton grouped matmul (``treadle/layers/moe_triton.py``) under TRITON_INTERPRET=1
on CPU tensors: every expert's run of sorted rows in one launch equals a torch matmul per expert
(float32 sums, within 1e-5), for runs shorter and longer than a tile, empty runs, and one rank's
part of the experts; and the fused layer gives the same output through it as through its
per-expert path.

TRITON_INTERPRET is set by this folder's conftest."""
from __future__ import annotations

import torch

from treadle.layers import moe_triton
from treadle.layers.moe import FusedMoE, route


def test_grouped_matmul_equals_a_matmul_per_expert() -> None:
    g = torch.Generator().manual_seed(0)
    counts = [3, 0, 21, 1, 16, 0]  # 21 > BLOCK_M: two tiles; empty runs: none
    n, k = 40, 48  # neither a multiple of its tile
    w = torch.randn(6, n, k, generator=g)
    for experts in (range(0, 6), range(2, 5)):
        rows = sum(counts[e] for e in experts)
        x = torch.randn(rows, k, generator=g)
        tiles = moe_triton.expert_tiles(counts, experts, x.device)
        got = moe_triton.grouped_matmul(x, w[experts.start : experts.stop], tiles)
        want, start = [], 0
        for local, e in enumerate(experts):
            want.append(x[start : start + counts[e]] @ w[experts.start + local].t())
            start += counts[e]
        torch.testing.assert_close(got, torch.cat(want), atol=1e-5, rtol=1e-5)


def test_fused_layer_same_through_triton_and_per_expert() -> None:
    g = torch.Generator().manual_seed(1)
    layer = FusedMoE(8, 32, 48, torch.float32, experts=range(2, 7))
    layer.w13.data.normal_(generator=g)
    layer.w2.data.normal_(generator=g)
    x = torch.randn(11, 32, generator=g)
    routing = route(torch.randn(11, 8, generator=g), 2, renormalize=False)
    flat = routing.ids.reshape(-1)
    counts = torch.bincount(flat, minlength=8).tolist()
    order = torch.argsort(flat, stable=True)
    first = sum(counts[:2])
    xs = x.index_select(0, order[first : first + sum(counts[2:7])] // 2)
    torch.testing.assert_close(layer._grouped_triton(xs, counts), layer._per_expert(xs, counts), atol=1e-4,
                               rtol=1e-4)
