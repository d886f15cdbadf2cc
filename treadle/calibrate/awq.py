"""AWQ (Lin et al. 2024): per input channel scales s = mean|X|^alpha (alpha searched on a
grid per group of linears, minimizing the group's output error after quantization), folded
into the preceding op, then round-to-nearest group quantization. alpha = 0 is plain RTN, so
the search never does worse than RTN on the calibration tokens."""
from __future__ import annotations

import torch
from torch import nn

from treadle.calibrate.grid import Grid
from treadle.calibrate.layers import SMOOTH_GROUPS, LayerInput, SmoothGroup, linear_inputs, run_layer
from treadle.calibrate.smooth import fold_scales, group_weight, tie_heads
from treadle.calibrate.smoothquant import rtn_layer

GRID_POINTS = 20
MAX_TOKENS = 1024  # calibration tokens the search uses per group (a fixed subsample)


def group_inputs(layer: nn.Module, inputs: list[LayerInput]) -> dict[str, torch.Tensor]:
    """Each smoothing group's input [tokens, in] from one float pass (subsampled)."""
    heads = [g.linears[0] for g in SMOOTH_GROUPS]
    parts: dict[str, list[torch.Tensor]] = {h: [] for h in heads}
    with linear_inputs(layer, heads, lambda name, x: parts[name].append(x)):
        run_layer(layer, inputs)
    out = {}
    for name, xs in parts.items():
        x = torch.cat(xs)
        if len(x) > MAX_TOKENS:
            x = x[torch.randperm(len(x), generator=torch.Generator().manual_seed(0))[:MAX_TOKENS]]
        out[name] = x
    return out


def search_scales(x: torch.Tensor, layer: nn.Module, group: SmoothGroup, grid: Grid) -> torch.Tensor:
    """The s (from the alpha grid) whose quantized weights best reproduce X W^T."""
    w = group_weight(layer, group)
    ref = x @ w.T
    xmean = x.abs().mean(0)
    if group.linears[0].endswith("o_proj"):
        xmean = tie_heads(xmean, layer, lambda g: g.mean(1))
    best, best_err = torch.ones_like(xmean), float("inf")
    for i in range(GRID_POINTS):
        s = xmean.pow(i / GRID_POINTS).clamp_min(1e-4)
        s = s / (s.max() * s.min()).sqrt()
        wq = grid.rtn(w * s)[0] / s
        err = float((x @ wq.T - ref).pow(2).mean())
        if err < best_err:
            best, best_err = s, err
    return best


@torch.no_grad()
def awq_layer(layer: nn.Module, inputs: list[LayerInput], grid: Grid, skip: set[str]) -> dict[str, torch.Tensor]:
    xs = group_inputs(layer, inputs)
    for group in SMOOTH_GROUPS:  # o_proj/down_proj first: their inputs shrink by the fold
        if not skip & set(group.linears):
            fold_scales(layer, group, search_scales(xs[group.linears[0]], layer, group, grid))
    return rtn_layer(layer, grid, skip)
