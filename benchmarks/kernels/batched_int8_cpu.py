"""The batched int8 matmul on SmolLM2-135M's shapes at batch 1 / 4 / 16 / 64: Treadle's 8-bit
activation path (packed Q4_1 rows, the Q8_0 lm_head) in this tree and in a git ref, against
FBGEMM and oneDNN through ``torch.ao.nn.quantized.dynamic.Linear`` (per-channel int8 weights,
activations quantized per call), side by side in one process, interleaved call by call.

    .venv/bin/python benchmarks/batched_int8_cpu.py [--ref HEAD] [--threads 1] [--batches 1 4 16 64] [--variants avx512-bf16]

Per shape and batch: the median time of one call over ``--repeats`` (thread CPU time with one
thread, so other jobs on a shared machine disturb it less; wall time with more); then the per-token total
of a decode step's matmuls (30 layers x qkv, o, gate_up, down + the lm_head) and its ratio to
batch 1. Weights are random and stay in cache (one copy per shape), so this is arithmetic, not
memory bandwidth. ``--ref none``: this tree only.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from gguf_files import random_blocks  # noqa: E402
from qmatmul_batch_cpu import SHAPES, build_ref, caller, pack_copies  # noqa: E402

from treadle.kernels import native  # noqa: E402


def torch_int8(engine: str, n: int, k: int, x: torch.Tensor) -> Callable[[], object]:
    """A dynamic int8 linear packed for ``engine`` (fbgemm / onednn), per-channel weights."""
    torch.backends.quantized.engine = engine
    lin = DynamicLinear(k, n, bias_=False, dtype=torch.qint8)
    w = torch.randn(n, k) * 0.05
    scales = w.abs().amax(1) / 127
    qw = torch.quantize_per_channel(w, scales, torch.zeros(n, dtype=torch.int64), 0, torch.qint8)
    lin.set_weight_bias(qw, None)
    return lambda: lin(x)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", default="none")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--variants", nargs="*", default=[], help="this tree's other builds too (e.g. avx512-bf16)")
    ap.add_argument("--no-torch", action="store_true", help="Treadle's kernels only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter  # one thread: less disturbed by others
    engines = [] if args.no_torch else [e for e in ("fbgemm", "onednn") if e in torch.backends.quantized.supported_engines]
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"treadle": native.library(), **{f"treadle {v}": native.library(variant=v) for v in args.variants}}
        if args.ref != "none":
            libs = {f"treadle@{args.ref}": build_ref(args.ref, Path(tmp)), **libs}
        names = [*libs, *engines]
        print(f"threads {args.threads}, median ms per call ({'thread CPU' if args.threads == 1 else 'wall'} time), variant {native.describe()}")
        print("| shape | path | " + " | ".join(f"M={m}" for m in args.batches) + " |")
        print("|---|---|" + "---|" * len(args.batches))
        step = {name: dict.fromkeys(args.batches, 0.0) for name in names}
        for shape, qtype, n, k, per_step in SHAPES:
            w = random_blocks(qtype, n, k, seed=1).data.reshape(-1)
            packed = pack_copies(list(libs.values()), qtype, [w], n, k)
            ptype = next((p for p, b in native.PACKED.items() if b == qtype), qtype)
            times: dict[str, dict[int, float]] = {name: {} for name in names}
            for m in args.batches:
                x = torch.randn(m, k)
                fns = {name: caller(lib, 8, *((ptype, packed[lib][0]) if lib in packed else (qtype, w)), n, k, x)
                       for name, lib in libs.items()}
                fns.update({e: torch_int8(e, n, k, x) for e in engines})
                samples: dict[str, list[float]] = {name: [] for name in names}
                for fn in fns.values():
                    fn()
                for _ in range(args.repeats):
                    for name, fn in fns.items():  # interleaved: all see the same machine load
                        if name in engines:
                            torch.backends.quantized.engine = name
                        t = clock()
                        fn()
                        samples[name].append(clock() - t)
                for name in names:
                    times[name][m] = statistics.median(samples[name]) * 1e3
                    step[name][m] += times[name][m] * per_step
            for name in names:
                print(f"| {shape} {n}x{k} | {name} | " + " | ".join(f"{times[name][m]:.3f}" for m in args.batches) + " |")
        for name in names:
            first = args.batches[0]
            cells = " | ".join(f"{step[name][m]:.2f} ({step[name][m] / step[name][first]:.2f}x)" for m in args.batches)
            print(f"| decode-step matmuls | {name} | {cells} |")


if __name__ == "__main__":
    main()
