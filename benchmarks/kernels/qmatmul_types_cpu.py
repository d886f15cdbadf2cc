"""The native GGUF matmul per block type, side by side: CPU time of one ``tq_matmul`` call
(one thread, thread CPU time, best of repeats) for a gate/up-sized weight and a few batch sizes.

    .venv/bin/python benchmarks/qmatmul_types_cpu.py [N] [K]          (default 3072 768)

Weights are random blocks with bounded scales (tests/gguf_files.py). K must be a multiple of
256 for the K-quants. The weight (a few MB) stays in cache across repeats, so this measures
the kernel's arithmetic, not memory bandwidth.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from gguf_files import random_blocks  # noqa: E402

from treadle.kernels import native  # noqa: E402

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def best_us(fn, calls: int = 20, repeats: int = 7) -> float:  # noqa: ANN001
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - t) / calls)
    return best * 1e6


def main() -> None:
    n, k = (int(a) for a in (sys.argv[1:3] if len(sys.argv) > 2 else (3072, 768)))
    torch.set_num_threads(1)
    batches = (1, 4, 16)
    print(f"weight {n} x {k}, one thread, microseconds per call (best of 7)")
    print("| type | bytes/weight | " + " | ".join(f"M={m}" for m in batches) + " | M=1 vs Q4_1 |")
    print("|---|---|" + "---|" * (len(batches) + 1))
    rows = {}
    for qtype in TYPES:
        w = random_blocks(qtype, n, k, seed=1).data.reshape(-1)
        xs = [torch.randn(m, k) for m in batches]
        rows[qtype] = (w.numel() / (n * k), [best_us(lambda x=x, w=w, s=((qtype, n),): native.qmatmul(s, w, x)) for x in xs])
    for qtype, (per_weight, times) in rows.items():
        cells = " | ".join(f"{t:.0f}" for t in times)
        print(f"| {qtype} | {per_weight:.3f} | {cells} | {times[0] / rows['Q4_1'][1][0]:.2f}x |")

if __name__ == "__main__":
    main()
