"""The batched int8 matmul on SmolLM2-135M's shapes at batch 1 / 4 / 16 / 64: Treadle's 8-bit
activation path (packed Q4_1 rows, the Q8_0 lm_head) in this tree and in a git ref, against
FBGEMM and oneDNN through ``torch.ao.nn.quantized.dynamic.Linear`` (per-channel int8 weights,
activations quantized per call), side by side in one process, interleaved call by call.

    .venv/bin/python benchmarks/kernels/batched_int8_cpu.py [--ref HEAD] [--threads 1] [--batches 1 4 16 64] [--variants avx512-bf16]
        [--cflags=-DAMX_MIN_PACKED=1]

Per shape and batch: the median time of one call over ``--repeats`` (thread CPU time with one
thread, so other jobs on a shared machine disturb it less; wall time with more); then the per-token total
of a decode step's matmuls (30 layers x qkv, o, gate_up, down + the lm_head) and its ratio to
batch 1. Weights are random and stay in cache (one copy per shape), so this is arithmetic, not
memory bandwidth. ``--ref none``: this tree only.
"""
from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import harness
import torch
from gguf_matmul import SHAPES, caller, pack_copies
from harness import Case
from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

from treadle.kernels import native


def torch_int8(engine: str, n: int, k: int, x: torch.Tensor) -> Callable[[], object]:
    """A dynamic int8 linear packed for ``engine`` (fbgemm / onednn), per-channel weights."""
    torch.backends.quantized.engine = engine
    lin = DynamicLinear(k, n, bias_=False, dtype=torch.qint8)
    w = torch.randn(n, k) * 0.05
    scales = w.abs().amax(1) / 127
    qw = torch.quantize_per_channel(w, scales, torch.zeros(n, dtype=torch.int64), 0, torch.qint8)
    lin.set_weight_bias(qw, None)
    return lambda: lin(x)


def use_engine(engine: str) -> Callable[[], None]:
    def switch() -> None:
        torch.backends.quantized.engine = engine
    return switch


def main() -> None:
    ap = harness.parser(__doc__, repeats=15, threads=1)
    ap.add_argument("--ref", default="none")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--variants", nargs="*", default=[], help="this tree's other builds too (e.g. avx512-bf16)")
    ap.add_argument("--no-torch", action="store_true", help="Treadle's kernels only")
    ap.add_argument("--cflags", default="", help="this tree built again with these compiler flags too (--cflags=-DAMX_MIN_PACKED=1)")
    args = ap.parse_args()
    run = harness.start(args)
    engines = [] if args.no_torch else [e for e in ("fbgemm", "onednn") if e in torch.backends.quantized.supported_engines]
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"treadle": native.library(), **{f"treadle {v}": native.library(variant=v) for v in args.variants}}
        if args.ref != "none":
            libs = {f"treadle@{args.ref}": harness.build_ref(args.ref, Path(tmp)), **libs}
        if args.cflags:
            libs[f"treadle {args.cflags}"] = harness.build_with(args.cflags, Path(tmp))
        names = [*libs, *engines]
        step = {name: dict.fromkeys(args.batches, 0.0) for name in names}
        table = run.table(["shape", "path", *(f"M={m}" for m in args.batches)], title="median ms per call")
        for shape, qtype, n, k, per_step in SHAPES:
            w = harness.random_blocks(qtype, n, k, seed=1)
            packed = pack_copies(list(libs.values()), qtype, [w], n, k)
            ptype = next((p for p, b in native.PACKED.items() if b == qtype), qtype)
            times: dict[str, dict[int, float]] = {name: {} for name in names}
            for m in args.batches:
                x = torch.randn(m, k)
                cases = [Case(name, caller(lib, 8, *((ptype, packed[lib][0]) if lib in packed else (qtype, w)), n, k, x))
                         for name, lib in libs.items()]
                cases += [Case(e, torch_int8(e, n, k, x), before=use_engine(e)) for e in engines]
                t = run.time(cases)
                for name in names:
                    times[name][m] = t.median(name) * 1e3
                    step[name][m] += times[name][m] * per_step
            for name in names:
                table.add([f"{shape} {n}x{k}", name, *(times[name][m] for m in args.batches)])
        first = args.batches[0]
        for name in names:
            table.add(["decode-step matmuls", name,
                       *(f"{step[name][m]:.2f} ({step[name][m] / step[name][first]:.2f}x)" for m in args.batches)])
    run.finish()


if __name__ == "__main__":
    main()
