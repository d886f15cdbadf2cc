"""Side-by-side timing of the fused operators vs their plain versions (SmolLM2-135M shapes).

Run: .venv/bin/python benchmarks/fused_ops_cpu.py [threads]
"""
from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch

from treadle.layers.activation import silu_and_mul, silu_and_mul_plain
from treadle.layers.norm import rms_norm_fused, rms_norm_plain
from treadle.layers.rotary import RotaryEmbedding

HIDDEN, INTER, H, HKV, D = 576, 1536, 9, 3, 64


def median_us(fn: Callable[[], object], reps: int = 300) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def op_pairs(tokens: int, w: torch.Tensor, fused_rope: RotaryEmbedding, plain_rope: RotaryEmbedding):
    x, res = torch.randn(tokens, HIDDEN), torch.randn(tokens, HIDDEN)
    gate_up = torch.randn(tokens, 2 * INTER)
    qkv = torch.randn(tokens, (H + 2 * HKV) * D)
    q = qkv[:, : H * D].view(tokens, H, D)
    k = qkv[:, H * D : (H + HKV) * D].view(tokens, HKV, D)
    pos = torch.arange(tokens) + 100
    return {
        "rmsnorm+residual": (lambda: rms_norm_plain(x, res, w, 1e-5), lambda: rms_norm_fused(x, res, w, 1e-5)),
        "swiglu": (lambda: silu_and_mul_plain(gate_up), lambda: silu_and_mul(gate_up)),
        "rope q+k": (lambda: plain_rope(pos, q, k), lambda: fused_rope(pos, q, k)),
    }


def main() -> None:
    if len(sys.argv) > 1:
        torch.set_num_threads(int(sys.argv[1]))
    w = torch.randn(HIDDEN)
    fused_rope = RotaryEmbedding(D, 2048, 1e5, None, fused=True)
    plain_rope = RotaryEmbedding(D, 2048, 1e5, None, fused=False)
    print(f"threads={torch.get_num_threads()}")
    print(f"{'op':28s} {'plain us':>9s} {'fused us':>9s} {'speedup':>8s}")
    for tokens in (1, 128):
        for name, (plain, fused) in op_pairs(tokens, w, fused_rope, plain_rope).items():
            p = statistics.median(median_us(plain) for _ in range(3))
            f = statistics.median(median_us(fused) for _ in range(3))
            print(f"{name + f' T={tokens}':28s} {p:9.1f} {f:9.1f} {p / f:7.2f}x")


if __name__ == "__main__":
    main()
