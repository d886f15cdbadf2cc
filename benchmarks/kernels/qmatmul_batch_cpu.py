"""The GGUF matmul on SmolLM2-135M's shapes at batch 1 / 4 / 16, this tree's kernels with 16-bit
and with 8-bit activations (csrc/q8act.c) against a git ref's (default ``main``; ``--ref none``:
this tree only), side by side in one process, interleaved call by call.

    .venv/bin/python benchmarks/kernels/qmatmul_batch_cpu.py [--ref main] [--threads 1]

Per shape and batch: the median over repeats of one ``tq_matmul`` call (thread CPU time with
one thread, so other jobs on a shared machine disturb it less; wall time with more), and the
per-token total of a decode step's matmuls (30 layers x q/k/v, o, gate/up, down + the Q8_0
lm_head), with its ratio to the first batch (``--batches 1 16 512``: other sizes). Weights are
random blocks (tests/gguf_files.py) that stay in cache, so this is the kernels' arithmetic, not
memory bandwidth; ``--cold`` gives each shape as many distinct weights as a step has (30 per layer
shape), called in turn, so a step's 92 MB come from memory as in a real decode step. A ref's kernels run with 16-bit and with 8-bit activations too; "a8 packed" is
this tree's 8-bit path on Q4 rows packed as a load with ``TREADLE_ACTIVATION_BITS=8`` packs them.
Builds whose packing gives the same bytes read the same copy of the weights: with a copy each, the
same source built twice read 576x1536 at M = 1 up to 20 % apart on the Zen 1 machine (where the
copies landed). A ref whose packed layout differs still reads its own copy, with that bias.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import harness
import torch
from gguf_matmul import SHAPES, caller, pack_copies
from harness import Case

from treadle.kernels import native


def main() -> None:
    ap = harness.parser(__doc__, repeats=15, threads=1)
    ap.add_argument("--ref", default="main")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--cold", action="store_true", help="distinct weights per layer, read from memory")
    args = ap.parse_args()
    run = harness.start(args)
    batches = tuple(args.batches)
    with tempfile.TemporaryDirectory() as tmp:
        this = native.library()
        libs = {"this tree a16": (this, 16, False), "this tree a8": (this, 8, False),
                "this tree a8 packed": (this, 8, True)}
        if args.ref != "none":
            ref = harness.build_ref(args.ref, Path(tmp))
            libs = {f"{args.ref} a16": (ref, 16, False), f"{args.ref} a8": (ref, 8, False),
                    **({f"{args.ref} a8 packed": (ref, 8, True)} if hasattr(ref, "tq_q8_pack") else {}), **libs}
        step = {name: dict.fromkeys(batches, 0.0) for name in libs}
        table = run.table(["shape", "build", *(f"M={m}" for m in batches)], title="median ms per call")
        for shape, qtype, n, k, per_step in SHAPES:
            copies = per_step if args.cold else 1
            ws = [harness.random_blocks(qtype, n, k, seed=1 + c) for c in range(copies)]
            packed = pack_copies([lib for lib, _, pack in libs.values() if pack], qtype, ws, n, k)
            ptype = next((p for p, b in native.PACKED.items() if b == qtype), qtype)
            times: dict[str, dict[int, float]] = {name: {} for name in libs}
            for m in batches:
                x = torch.randn(m, k)
                cases = []
                for name, (lib, bits, pack) in libs.items():
                    calls = [caller(lib, bits, *((ptype, packed[lib][c]) if pack and lib in packed else (qtype, w)),
                                    n, k, x) for c, w in enumerate(ws)]
                    cases.append(Case(name, lambda calls=calls: [fn() for fn in calls], calls=copies))
                t = run.time(cases)
                for name in libs:
                    times[name][m] = t.median(name) * 1e3
                    step[name][m] += times[name][m] * per_step
            for name in libs:
                table.add([f"{shape} {qtype} {n}x{k}", name, *(times[name][m] for m in batches)])
        for name in libs:
            table.add(["decode-step matmuls", name,
                       *(f"{step[name][m]:.2f} ({step[name][m] / step[name][batches[0]]:.2f}x)" for m in batches)])
    run.finish()


if __name__ == "__main__":
    main()
