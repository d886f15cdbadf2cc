"""SmoothQuant (Xiao et al. 2023): migrate activation outliers into the weights with
per-channel s_j = max|X_j|^alpha / max|W_j|^(1 - alpha), folded into the preceding op,
then int8 per-channel weights (activations are quantized per token at run time)."""
from __future__ import annotations

import torch
from torch import nn

from treadle.calibrate.grid import Grid
from treadle.calibrate.layers import SMOOTH_GROUPS, LayerInput, SmoothGroup, linear_inputs, run_layer
from treadle.calibrate.smooth import fold_scales, group_weight, tie_heads


def activation_absmax(layer: nn.Module, inputs: list[LayerInput]) -> dict[str, torch.Tensor]:
    """max |X_j| over the calibration tokens at each smoothing group's input [in]."""
    heads = [g.linears[0] for g in SMOOTH_GROUPS]
    stats: dict[str, torch.Tensor] = {}

    def sink(name: str, x: torch.Tensor) -> None:
        m = x.abs().amax(0)
        stats[name] = torch.maximum(stats[name], m) if name in stats else m

    with linear_inputs(layer, heads, sink):
        run_layer(layer, inputs)
    return stats


def smoothing_scales(xmax: torch.Tensor, layer: nn.Module, group: SmoothGroup, alpha: float) -> torch.Tensor:
    wmax = group_weight(layer, group).abs().amax(0)
    if group.linears[0].endswith("o_proj"):
        xmax, wmax = (tie_heads(t, layer, lambda g: g.amax(1)) for t in (xmax, wmax))
    s = xmax.clamp_min(1e-5).pow(alpha) / wmax.clamp_min(1e-5).pow(1 - alpha)
    return torch.where(xmax > 0, s.clamp_min(1e-5), torch.ones_like(s))


@torch.no_grad()
def smooth_layer(layer: nn.Module, inputs: list[LayerInput], alpha: float) -> None:
    """Fold SmoothQuant scales into the layer (float outputs unchanged)."""
    stats = activation_absmax(layer, inputs)
    for group in SMOOTH_GROUPS:
        fold_scales(layer, group, smoothing_scales(stats[group.linears[0]], layer, group, alpha))


@torch.no_grad()
def smoothquant_layer(layer: nn.Module, inputs: list[LayerInput], grid: Grid, alpha: float) -> dict[str, torch.Tensor]:
    smooth_layer(layer, inputs, alpha)
    return rtn_layer(layer, grid)


@torch.no_grad()
def rtn_layer(layer: nn.Module, grid: Grid, skip: set[str] = frozenset()) -> dict[str, torch.Tensor]:  # type: ignore[assignment]
    """Round every linear of the layer (but ``skip``) to the grid in place; scales by name."""
    scales = {}
    for name, lin in layer.named_modules():
        if isinstance(lin, nn.Linear) and name not in skip:
            lin.weight.data, scales[name] = grid.rtn(lin.weight.data)
    return scales
