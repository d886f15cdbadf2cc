"""GPTQ (Frantar et al. 2023): quantize a linear's weight one input column at a time and
spread each column's rounding error over the columns not yet quantized, weighted by the
inverse Hessian of the layer's squared output error, H = 2 X^T X / n.

    columns  [ done | block being quantized (one at a time) | rest ]
                      ^ error of each column updates the block   ^ updated once per block
                        (lazy batch update: one matmul per block for the rest)
"""
from __future__ import annotations

import torch
from torch import nn

from treadle.calibrate.grid import Grid
from treadle.calibrate.layers import SMOOTH_GROUPS, LayerInput, linear_inputs, linears, run_layer
from treadle.config import TreadleError

BLOCK = 128


class HessianSum:
    """Running 2 X^T X / n of a linear's inputs (products in float32, the sum in float64)."""

    def __init__(self, in_features: int) -> None:
        self.h = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:  # [tokens, in]
        x = x.to(torch.float32)
        self.h.mul_(self.n / (self.n + len(x))).add_((x.T @ x).to(torch.float64), alpha=2.0 / (self.n + len(x)))
        self.n += len(x)


def _inverse_hessian_factor(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of the dampened H^-1 (rows give the error-propagation weights)."""
    h = h.clone()
    h.diagonal().add_(damp * h.diagonal().mean())
    try:
        hinv = torch.cholesky_inverse(torch.linalg.cholesky(h))
        return torch.linalg.cholesky(hinv, upper=True)
    except torch.linalg.LinAlgError:
        raise TreadleError("GPTQ: the Hessian is not positive definite; raise the dampening or use more "
                           "calibration samples") from None


@torch.no_grad()
def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, grid: Grid, damp: float = 0.01,
                  act_order: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(fake-quantized weight [out, in], scales [out, groups]). With ``act_order`` columns go
    in order of decreasing H diagonal; group scales are then fixed up front from the original
    weight (static groups), so the checkpoint needs no column permutation."""
    w = weight.to(torch.float64).clone()
    h = hessian.clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    cols = w.shape[1]
    gs = grid.group_size or cols
    scales = grid.scales(w) if act_order or grid.group_size is None else torch.empty(w.shape[0], cols // gs,
                                                                                     dtype=w.dtype)
    perm = torch.argsort(h.diagonal(), descending=True) if act_order else torch.arange(cols)
    w, h = w[:, perm], h[perm][:, perm]
    u = _inverse_hessian_factor(h, damp)
    q = torch.zeros_like(w)
    for b0 in range(0, cols, BLOCK):
        b1 = min(b0 + BLOCK, cols)
        wb, err = w[:, b0:b1].clone(), torch.zeros(w.shape[0], b1 - b0, dtype=w.dtype)
        for i in range(b1 - b0):
            col = int(perm[b0 + i])
            if not act_order and grid.group_size is not None and col % gs == 0:
                scales[:, col // gs] = grid.scales(wb[:, i:i + gs])[:, 0]  # groups lie inside one block
            s = scales[:, col // gs]
            q[:, b0 + i] = torch.clamp(torch.round(wb[:, i] / s), -grid.qmax - 1, grid.qmax) * s
            e = (wb[:, i] - q[:, b0 + i]) / u[b0 + i, b0 + i]
            wb[:, i:] -= e.unsqueeze(1) * u[b0 + i, b0 + i:b1].unsqueeze(0)
            err[:, i] = e
        w[:, b1:] -= err @ u[b0:b1, b1:]
    q = q[:, torch.argsort(perm)]
    return q.to(weight.dtype), scales.to(weight.dtype)


@torch.no_grad()
def gptq_layer(layer: nn.Module, inputs: list[LayerInput], grid: Grid, damp: float,
               act_order: bool, skip: set[str]) -> dict[str, torch.Tensor]:
    """Hessians of every linear (but ``skip``) from one float pass of the layer (one per
    distinct input: q/k/v share one, gate/up another), then GPTQ each in place."""
    mods = {n: m for n, m in linears(layer).items() if n not in skip}
    shared = {n: g.linears[0] for g in SMOOTH_GROUPS for n in g.linears if n in mods}
    source = {n: shared.get(n, n) for n in mods}
    sums = {s: HessianSum(mods[s].in_features) for s in set(source.values())}
    with linear_inputs(layer, list(sums), lambda name, x: sums[name].add(x)):
        run_layer(layer, inputs)
    scales = {}
    for name, m in mods.items():
        m.weight.data, scales[name] = gptq_quantize(m.weight.data, sums[source[name]].h, grid, damp, act_order)
    return scales
