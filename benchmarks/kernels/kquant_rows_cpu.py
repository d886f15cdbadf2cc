"""The K-quant rows (and Q4_0) of the 1.1B-class model's matmul shapes at batch 1 and 16, this
tree's kernels against a git ref's (default ``HEAD``; ``--ref none``: this tree only), side by side
in one process, interleaved call by call, 16-bit activations (the default).

    .venv/bin/python benchmarks/kernels/kquant_rows_cpu.py [--ref HEAD] [--threads 1] [--cold]

Shapes: TinyLlama-1.1B's q/k/v (2560 x 2048), o (2048 x 2048), gate/up (11264 x 2048), down
(2048 x 5632) in Q4_K, Q6_K and Q4_0 (the types llama.cpp's Q4_K_M and Q4_0 files hold). Per shape,
type and batch: the median ms of one ``tq_matmul`` call and the weight bytes it read per second
(GB/s). Weights are random blocks (tests/gguf_files.py) that stay in cache, unless ``--cold``:
then each shape has 8 distinct copies called in turn (> the L2, read from L3 or memory).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import harness
import torch
from gguf_matmul import caller
from harness import Case

from treadle.kernels import native

SHAPES = [("qkv", 2560, 2048), ("o", 2048, 2048), ("gate_up", 11264, 2048), ("down", 2048, 5632)]
TYPES = ["Q4_K", "Q6_K", "Q4_0"]
BYTES = {"Q4_K": 144 / 256, "Q6_K": 210 / 256, "Q4_0": 18 / 32}  # per weight


def main() -> None:
    ap = harness.parser(__doc__, repeats=9, threads=1)
    ap.add_argument("--ref", default="HEAD")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--types", nargs="+", default=TYPES)
    ap.add_argument("--cold", action="store_true", help="8 distinct weights per shape, called in turn")
    args = ap.parse_args()
    run = harness.start(args)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"this tree": native.library()}
        if args.ref != "none":
            libs = {args.ref: harness.build_ref(args.ref, Path(tmp)), **libs}
        base = next(iter(libs))
        table = run.table(["shape", "type", "M", *(f"{name} ms" for name in libs), *(f"{name} GB/s" for name in libs),
                           "speed-up"], title="median per call (16-bit activations)")
        for qtype in args.types:
            for shape, n, k in SHAPES:
                copies = 8 if args.cold else 1
                ws = [harness.random_blocks(qtype, n, k, seed=1 + c) for c in range(copies)]
                for m in args.batches:
                    x = torch.randn(m, k)
                    calls = {name: [caller(lib, 16, qtype, w, n, k, x) for w in ws] for name, lib in libs.items()}
                    cases = [Case(name, lambda fns=fns: [f() for f in fns], calls=copies) for name, fns in calls.items()]
                    t = run.time(cases)
                    ms = {name: t.median(name) * 1e3 for name in libs}
                    gbs = {name: n * k * BYTES[qtype] / (ms[name] * 1e6) for name in libs}
                    table.add([shape, qtype, m, *ms.values(), *(f"{g:.1f}" for g in gbs.values()),
                               f"{t.ratio(base, 'this tree') if len(libs) > 1 else 1.0:.2f}"])
    run.finish()


if __name__ == "__main__":
    main()
