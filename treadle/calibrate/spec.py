"""What ``treadle quantize`` was asked for, checked once."""
from __future__ import annotations

from dataclasses import dataclass

from treadle.config import TreadleError

METHODS = ("rtn", "smoothquant", "gptq", "awq")
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class QuantizeSpec:
    """``bits`` 8: int8 per-channel weights (with smoothquant/rtn, plus dynamic per-token int8
    activations: W8A8); 4: int4 weights in groups of ``group_size`` input columns (W4A16).
    Weights are symmetric (no zero point)."""

    method: str
    bits: int
    group_size: int | None  # None: one scale per output channel
    alpha: float = 0.8  # SmoothQuant migration strength
    num_samples: int = 64
    seq_len: int = 256
    act_order: bool = False  # GPTQ: columns in order of decreasing Hessian diagonal
    damp: float = 0.01  # GPTQ: dampening, a fraction of the Hessian's mean diagonal
    activations: bool = False  # quantize activations too (W8A8)

    @staticmethod
    def build(method: str, bits: int | None, group_size: int | None, alpha: float, num_samples: int,
              seq_len: int, act_order: bool = False) -> QuantizeSpec:
        """Defaults: smoothquant -> W8A8; gptq/awq -> int4 group 128; rtn -> int8 W8A8
        (or int4 group 128 with ``bits`` 4)."""
        if method not in METHODS:
            raise TreadleError(f"--method {method!r} is not known (choose from {', '.join(METHODS)})")
        if bits is None:
            bits = 8 if method in ("smoothquant", "rtn") else 4
        if bits not in (4, 8):
            raise TreadleError(f"--bits {bits} is not supported (4 or 8)")
        if method == "smoothquant" and bits != 8:
            raise TreadleError("smoothquant writes W8A8: use --bits 8")
        if method == "awq" and bits != 4:
            raise TreadleError("awq writes int4 weights: use --bits 4")
        if bits == 4 and group_size is None:
            group_size = 128
        if bits == 8 and group_size is not None:
            raise TreadleError("--group-size applies to --bits 4 (8-bit weights have one scale per channel)")
        if group_size is not None and group_size not in GROUP_SIZES:
            raise TreadleError(f"--group-size {group_size} is not supported ({', '.join(map(str, GROUP_SIZES))})")
        if not 0.0 <= alpha <= 1.0:
            raise TreadleError(f"--alpha {alpha} must lie in [0, 1]")
        if num_samples < 1 or seq_len < 8:
            raise TreadleError("--num-samples must be >= 1 and --seq-len >= 8")
        return QuantizeSpec(method, bits, group_size, alpha, num_samples, seq_len, act_order,
                            activations=bits == 8 and method in ("smoothquant", "rtn"))
