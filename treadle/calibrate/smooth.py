"""Per-input-channel scales folded into the op before a group of linears (shared by
SmoothQuant and AWQ). Folding is exact in float: X W^T = (X / s)(W diag(s))^T, and X / s
comes out of the preceding RMSNorm (weight / s) or linear (output rows / s).

o_proj reads the attention output, whose channel (head h, d) is a mix of v_proj's channel
(kv head of h, d) only; dividing that v_proj row by s is exact when every query head of one
KV group uses the same s for its d -- ``tie_heads`` makes a per-channel statistic so.

    o_proj input channels   [h0 d0..dn | h1 d0..dn | h2 ... | h3 ...]   (2 heads per KV head)
    v_proj output rows      [  kv0 d0..dn          |  kv1 d0..dn     ]
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from treadle.calibrate.layers import SmoothGroup, linear


def head_groups(layer: nn.Module) -> tuple[int, int]:
    """(KV heads, query heads per KV head) of the layer's attention."""
    attn: Any = layer.get_submodule("self_attn")  # transformers' attention: head_dim is a plain int
    head_dim = int(attn.head_dim)
    kv = linear(layer, "self_attn.v_proj").out_features // head_dim
    return kv, linear(layer, "self_attn.o_proj").in_features // (kv * head_dim)


def tie_heads(stat: torch.Tensor, layer: nn.Module,
              reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """A statistic over o_proj's input channels [heads * head_dim] made equal across the
    query heads of each KV group (``reduce`` over dim 1 of [kv, rep, head_dim])."""
    kv, rep = head_groups(layer)
    grouped = stat.view(kv, rep, -1)
    return reduce(grouped).unsqueeze(1).expand_as(grouped).reshape(-1)


def group_weight(layer: nn.Module, group: SmoothGroup) -> torch.Tensor:  # [sum of out, in]
    return torch.cat([linear(layer, n).weight.data for n in group.linears])


@torch.no_grad()
def fold_scales(layer: nn.Module, group: SmoothGroup, s: torch.Tensor) -> None:
    """Multiply the group's weight columns by ``s`` [in] and divide the preceding op's output
    channels by it (``s`` must be head-tied for o_proj)."""
    for name in group.linears:
        linear(layer, name).weight.mul_(s)
    prev = layer.get_submodule(group.prev)
    if isinstance(prev, nn.Linear):
        rows = s
        if prev.out_features != s.numel():  # v_proj before o_proj under grouped-query attention
            kv, rep = head_groups(layer)
            rows = s.view(kv, rep, -1)[:, 0].reshape(-1)
        prev.weight.div_(rows.unsqueeze(1))
        if prev.bias is not None:
            prev.bias.div_(rows)
    else:  # RMSNorm
        weight = prev.weight
        assert isinstance(weight, torch.Tensor)
        weight.div_(s)
