"""Symmetric integer grids: scales and round-to-nearest fake quantization (the weights
written are exactly ``q * scale``, so the writer recovers ``q`` by dividing)."""
from __future__ import annotations

from typing import NamedTuple

import torch


class Grid(NamedTuple):
    bits: int
    group_size: int | None  # None: per output channel

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size is None else in_features // self.group_size

    def scales(self, w: torch.Tensor) -> torch.Tensor:  # [out, in] -> [out, groups]
        """Absmax scales, one per output row and group of input columns."""
        grouped = w.reshape(w.shape[0], self.groups(w.shape[1]), -1)
        return (grouped.abs().amax(-1) / self.qmax).clamp_min(1e-10)

    def fake_quant(self, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Round ``w`` [out, in] onto the grid given by ``scales`` [out, groups]; back in float."""
        grouped = w.reshape(w.shape[0], scales.shape[1], -1)
        s = scales.unsqueeze(-1)
        q = torch.clamp(torch.round(grouped / s), -self.qmax - 1, self.qmax)
        return (q * s).reshape(w.shape)

    def rtn(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(fake-quantized weight, scales) by round-to-nearest."""
        scales = self.scales(w)
        return self.fake_quant(w, scales), scales
