"""The native GGUF matmul per block type, side by side: CPU time of one ``tq_matmul`` call
(one thread, thread CPU time, best of repeats) for a gate/up-sized weight and a few batch sizes.

    .venv/bin/python benchmarks/kernels/qmatmul_types_cpu.py [N] [K] [--repeats 7]     (default 3072 768)

Weights are random blocks with bounded scales (tests/gguf_files.py). K must be a multiple of
256 for the K-quants. The weight (a few MB) stays in cache across repeats, so this measures
the kernel's arithmetic, not memory bandwidth.
"""
from __future__ import annotations

import harness
import torch
from harness import Case

from treadle.kernels import native

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
CALLS = 20  # per timed sample


def main() -> None:
    ap = harness.parser(__doc__, repeats=7, threads=1)
    ap.add_argument("n", type=int, nargs="?", default=3072)
    ap.add_argument("k", type=int, nargs="?", default=768)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    args = ap.parse_args()
    run = harness.start(args)
    n, k = args.n, args.k
    weights = {qtype: harness.random_blocks(qtype, n, k, seed=1) for qtype in TYPES}
    best: dict[str, list[float]] = {qtype: [] for qtype in TYPES}
    for m in args.batches:
        x = torch.randn(m, k)
        cases = [Case(qtype, lambda s=((qtype, n),), w=w, x=x: [native.qmatmul(s, w, x) for _ in range(CALLS)], calls=CALLS)
                 for qtype, w in weights.items()]
        t = run.time(cases)  # the types interleaved, round by round
        for qtype in TYPES:
            best[qtype].append(t.best(qtype) * 1e6)
    rows = [[qtype, w.numel() / (n * k), *(f"{us:.0f}" for us in best[qtype]), f"{best[qtype][0] / best['Q4_1'][0]:.2f}x"]
            for qtype, w in weights.items()]
    run.table(["type", "bytes/weight", *(f"M={m}" for m in args.batches), f"M={args.batches[0]} vs Q4_1"], rows,
              title=f"weight {n} x {k}, microseconds per call (best of {args.repeats})")
    run.finish()


if __name__ == "__main__":
    main()
