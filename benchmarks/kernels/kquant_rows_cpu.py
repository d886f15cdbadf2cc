"""The K-quant rows (and Q4_0) of the 1.1B-class model's matmul shapes at batch 1 and 16, this
tree's kernels against a git ref's (default ``HEAD``; ``--ref none``: this tree only), side by side
in one process, interleaved call by call, 16-bit activations (the default).

    .venv/bin/python benchmarks/kernels/kquant_rows_cpu.py [--ref HEAD] [--threads 1] [--cold]
        [--activation-bits 16 8] [--batches 1 16 128] [--types Q4_K Q6_K Q4_0] [--variants amx avx512-vnni]

``--activation-bits`` with several values times each library at each (a column per pair, the
speed-up the last column's over the first's); at 8 bits Q4_0, Q4_K and Q6_K are packed 8 rows at
a time as a load with ``TREADLE_ACTIVATION_BITS=8`` packs them (``native.pack_rows``).
``--file-layout`` adds a first column: this tree at 8 bits on the rows as the file has them (not
packed), so the speed-up is packing's (``--ref none --activation-bits 8 --file-layout``; a ref
from before a type was packable cannot read this tree's packed layout). ``--variants`` times this
tree's builds of those names (``TREADLE_CPU_KERNELS``'s, e.g. ``avx512-vnni amx``: the speed-up is
then amx's over avx512-vnni's) in place of the selected build.

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
from gguf_matmul import caller, pack_copies
from harness import Case

from treadle.kernels import native

SHAPES = [("qkv", 2560, 2048), ("o", 2048, 2048), ("gate_up", 11264, 2048), ("down", 2048, 5632)]
TYPES = ["Q4_K", "Q6_K", "Q4_0"]
BYTES = {"Q4_K": 144 / 256, "Q5_K": 176 / 256, "Q6_K": 210 / 256, "Q4_0": 18 / 32, "Q4_1": 20 / 32,  # per weight
         "Q5_0": 22 / 32, "Q5_1": 24 / 32, "Q8_0": 34 / 32}


def main() -> None:
    ap = harness.parser(__doc__, repeats=9, threads=1)
    ap.add_argument("--ref", default="HEAD")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--types", nargs="+", default=TYPES)
    ap.add_argument("--activation-bits", type=int, nargs="+", default=[16], choices=[8, 16])
    ap.add_argument("--cold", action="store_true", help="8 distinct weights per shape, called in turn")
    ap.add_argument("--variants", nargs="*", default=[], help="this tree's builds to time (default: the selected one)")
    ap.add_argument("--file-layout", action="store_true", help="also this tree at 8 bits on unpacked rows (first column)")
    args = ap.parse_args()
    run = harness.start(args)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {v: native.library(variant=v) for v in args.variants} if args.variants else {"this tree": native.library()}
        if args.ref != "none":
            libs = {args.ref: harness.build_ref(args.ref, Path(tmp)), **libs}
        cols = [(name, bits) for name in libs for bits in args.activation_bits]
        label = {c: c[0] if len(args.activation_bits) == 1 else f"{c[0]} a{c[1]}" for c in cols}
        if args.file_layout:  # (name, 0): this tree's first library at 8 bits on the file's rows
            first = next(n for n in libs if n != args.ref)
            cols.insert(0, (first, 0))
            label[(first, 0)] = f"{first} a8 file layout"
        table = run.table(["shape", "type", "M", *(f"{label[c]} ms" for c in cols), *(f"{label[c]} GB/s" for c in cols),
                           "speed-up"], title=f"median per call ({'/'.join(map(str, args.activation_bits))}-bit activations)")
        for qtype in args.types:
            for shape, n, k in SHAPES:
                copies = 8 if args.cold else 1
                ws = [harness.random_blocks(qtype, n, k, seed=1 + c) for c in range(copies)]
                packed = pack_copies(list(libs.values()), qtype, ws, n, k) if 8 in args.activation_bits or args.file_layout else {}
                pname = next((p for p, b in native.PACKED.items() if b == qtype), qtype)
                for m in args.batches:
                    x = torch.randn(m, k)
                    calls = {c: [caller(libs[c[0]], c[1], pname, w, n, k, x) for w in packed[libs[c[0]]]]
                             if c[1] == 8 and libs[c[0]] in packed else
                             [caller(libs[c[0]], c[1] or 8, qtype, w, n, k, x) for w in ws]
                             for c in cols}
                    cases = [Case(label[c], lambda fns=fns: [f() for f in fns], calls=copies) for c, fns in calls.items()]
                    t = run.time(cases)
                    ms = {c: t.median(label[c]) * 1e3 for c in cols}
                    gbs = {c: n * k * BYTES[qtype] / (ms[c] * 1e6) for c in cols}
                    table.add([shape, qtype, m, *ms.values(), *(f"{g:.1f}" for g in gbs.values()),
                               f"{t.ratio(label[cols[0]], label[cols[-1]]) if len(cols) > 1 else 1.0:.2f}"])
    run.finish()

if __name__ == "__main__":
    main()
