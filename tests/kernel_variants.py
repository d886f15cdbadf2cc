"""Shared by the C-kernel variant tests: every build in ``native.VARIANTS`` as a parameter, and
a skip naming the CPU features a variant needs and this machine lacks."""
from __future__ import annotations

import pytest
import torch

from treadle.kernels import native

VARIANTS = pytest.mark.parametrize("variant", [v.name for v in native.VARIANTS])


def runnable(variant: str) -> str:
    """``variant``, or a skip when this CPU cannot run it (the reason names the missing features)."""
    missing = native.missing_features(variant)
    if missing:
        pytest.skip(f"{variant}: this CPU lacks {' '.join(missing)}")
    return variant


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def force(monkeypatch: pytest.MonkeyPatch, variant: str) -> str:
    """Run the engine's kernels as ``variant`` (``TREADLE_CPU_KERNELS``) for this test, or skip
    naming the features this CPU lacks."""
    monkeypatch.setenv("TREADLE_CPU_KERNELS", runnable(variant))
    assert native.selected_variant() == variant
    return variant
