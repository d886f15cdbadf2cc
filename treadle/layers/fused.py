"""The switch for fused operators (RMSNorm with the residual add, SwiGLU, in-place RoPE).

Fused here means fewer, in-place plain-torch calls with the same arithmetic as the
plain versions (measured faster on CPU than torch.compile, whose per-call guard cost
exceeds a decode step's kernel time, and than a C++ extension, whose first build takes
minutes on a small machine). ``TREADLE_FUSED_OPS=0`` selects the plain versions.
"""
from __future__ import annotations

from treadle import envs


def fused_ops_enabled() -> bool:
    """Read once by each layer at construction time."""
    return envs.fused_ops()
