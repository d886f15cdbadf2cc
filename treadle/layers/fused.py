"""The switch for fused operators (RMSNorm with the residual add, SwiGLU, in-place RoPE).

Fused here means fewer calls over the same arithmetic as the plain versions: for float32
on the CPU each is one call into Treadle's C kernels (``treadle/kernels/ops.py``), for CUDA
tensors one Triton launch (``treadle/layers/triton_ops.py``), elsewhere a few in-place torch
calls; results agree with the plain versions (tests/kernels/test_fused_ops.py,
tests/gpu/test_triton_ops.py).
The one-call decoder layer (``treadle/layers/fused_decoder.py``) builds on these and needs
them on.
``TREADLE_FUSED_OPS=0`` selects the plain versions.
"""
from __future__ import annotations

from functools import cache
from types import ModuleType

import torch

from treadle import envs


def fused_ops_enabled() -> bool:
    """Read once by each layer at construction time."""
    return envs.fused_ops()


def triton_ops(t: torch.Tensor) -> ModuleType | None:
    """``treadle.layers.triton_ops`` when ``t`` is a CUDA tensor with unit-stride rows and triton
    imports; else None (the caller's torch path). The CPU never imports triton."""
    return _load_triton_ops() if t.is_cuda and t.stride(-1) == 1 else None


@cache
def _load_triton_ops() -> ModuleType | None:
    try:
        from treadle.layers import triton_ops
    except ImportError:
        return None
    return triton_ops
