"""The switch for fused operators (RMSNorm with the residual add, SwiGLU, in-place RoPE).

Fused here means fewer calls over the same arithmetic as the plain versions: for float32
on the CPU each is one call into Treadle's C kernels (``treadle/kernels/ops.py``), elsewhere
a few in-place torch calls; results agree with the plain versions (tests/kernels/test_fused_ops.py).
The one-call decoder layer (``treadle/layers/fused_decoder.py``) builds on these and needs
them on.
``TREADLE_FUSED_OPS=0`` selects the plain versions.
"""
from __future__ import annotations

from treadle import envs


def fused_ops_enabled() -> bool:
    """Read once by each layer at construction time."""
    return envs.fused_ops()
