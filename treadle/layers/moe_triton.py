"""The MoE layer's grouped matmul as one Triton kernel (CUDA; imported by ``treadle.layers.moe``
only when the experts live on a GPU, so the rest of the engine imports without triton). Under
``TRITON_INTERPRET=1`` the same kernel runs on CPU tensors (the tests' oracle runs).

The step's assignment rows are already sorted by expert (``FusedMoE``), so expert e's rows are
one run [start_e, end_e) of x. The host cuts every run into tiles of BLOCK_M rows and lists each
tile's (expert, first row, end row); one program per (tile, BLOCK_N columns) computes::

    y[r, n] = sum_k x[r, k] * w[e, n, k]      r in [row0, min(row0 + BLOCK_M, end)), float32 sums

so all experts run in one launch instead of one pair of matmuls per expert.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


@triton.jit
def grouped_matmul_kernel(x_ptr, w_ptr, y_ptr, tiles_ptr, N, K,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """x [R, K], w [E, N, K], y [R, N] (all contiguous); tiles [T, 3] int64: expert, first row,
    end row of each tile."""
    tile, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(tiles_ptr + tile * 3)
    row0 = tl.load(tiles_ptr + tile * 3 + 1)
    end = tl.load(tiles_ptr + tile * 3 + 2)
    rm = row0 + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_base = w_ptr + expert * N * K
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < end) & (kk[None, :] < K), other=0.0)
        w = tl.load(w_base + rn[None, :] * K + kk[:, None], mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < end) & (rn[None, :] < N))


def expert_tiles(counts: list[int], experts: range, device: torch.device) -> torch.Tensor:
    """[T, 3] int64 (expert's local index, first row, end row) tiles of BLOCK_M rows over this
    rank's experts' runs of the sorted rows (``counts``: rows per global expert)."""
    tiles, row = [], 0
    for local, expert in enumerate(experts):
        end = row + counts[expert]
        tiles += [(local, r, end) for r in range(row, end, BLOCK_M)]
        row = end
    return torch.tensor(tiles, dtype=torch.int64, device=device).reshape(-1, 3)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
    """x [R, K] rows grouped by expert, w [E, N, K], tiles from ``expert_tiles`` -> [R, N]."""
    x, w = x.contiguous(), w.contiguous()
    n, k = w.shape[1], w.shape[2]
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if tiles.shape[0]:
        grid = (tiles.shape[0], triton.cdiv(n, BLOCK_N))
        grouped_matmul_kernel[grid](x, w, y, tiles, n, k, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return y
