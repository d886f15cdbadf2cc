"""Decode attention against its memory floor on the CPU (#16 item 4).

The C paged-decode kernel (``paged_decode``) on SmolLM2-135M's shapes (9 query heads, 3 KV heads,
head_dim 64, block 16, 30 layers) at batch x context, per layer, against the time it takes just
to read the KV bytes it must read (K and V of every context token, once) at this machine's
measured read bandwidth, measured in the same process with the same threads:

    read bandwidth   torch sum over a 512 MiB float32 tensor (reads only, nothing written)
    copy bandwidth   dst.copy_(src), 256 MiB each way (bytes read + bytes written)

    floor ms = KV bytes / read bandwidth;  achieved GB/s = KV bytes / kernel time

Each timed pass walks separate caches (>= 256 MiB in all, well past the L3), as a step's layers
do, so K/V come from memory. Clock: thread CPU time with one thread (other jobs on a shared
machine then cost less), wall time with more; minimum and median of repeats (the minimum is the
better estimate of what the kernel costs; the median shows the noise).

Run: .venv/bin/python benchmarks/kernels/attention_floor_cpu.py [--threads N] [--batch 16] [--context 1000]

``--ref REF`` also builds git ref REF's kernels and times them on the same caches, call by call
interleaved with this tree's (both through ctypes, so neither pays the Python wrapper), and
prints their ratio per case: the A/B for a change to ``paged_attention.c``.
"""
from __future__ import annotations

import ctypes
import tempfile
from collections.abc import Callable
from pathlib import Path

import harness
import torch
from harness import Case, Run, Timings

from treadle.kernels import native
from treadle.kernels.attention import KV_FORMATS, paged_decode
from treadle.layers.attention import build_attention_metadata
from treadle.layers.attention.cpu import build_plan

H, HKV, D, BS, LAYERS = 9, 3, 64, 16, 30
COLD_BYTES = 256 << 20
FORMATS = {"float32": (torch.float32, 0), "bfloat16": (torch.bfloat16, 0), "int8": (torch.int8, 4)}


def bandwidth(run: Run, repeats: int = 9) -> tuple[float, float]:
    """(read GB/s, copy GB/s counting read + written bytes), best of repeats."""
    big = torch.rand(128 << 20)  # 512 MiB
    src, dst = big[: 64 << 20], torch.empty(64 << 20)
    t = run.time([Case("read", lambda: big.sum()), Case("copy", lambda: dst.copy_(src))], repeats, warmup=1)
    return big.numel() * 4 / t.best("read") / 1e9, 2 * src.numel() * 4 / t.best("copy") / 1e9


def kv_case(run: Run, batch: int, context: int, fmt: str, ref_name: str | None = None,
            ref: ctypes.CDLL | None = None) -> tuple[Timings, int]:
    """(seconds per layer call of "this tree" and, with a ref, of ``ref_name``; KV bytes read) of
    one layer's decode attention over a cold cache."""
    dtype, extra = FORMATS[fmt]
    g = torch.Generator().manual_seed(0)
    need = -(-context // BS)
    perm = torch.randperm(batch * need + 4, generator=g).tolist()
    tables = [perm[i * need : (i + 1) * need] for i in range(batch)]
    shape = (len(perm), BS, HKV, D + extra)
    row_bytes = HKV * (D + extra) * torch.empty(0, dtype=dtype).element_size()
    copies = max(2, -(-COLD_BYTES // (2 * len(perm) * BS * row_bytes)))

    def cache() -> torch.Tensor:
        if dtype is torch.int8:  # int8 values and a positive float32 scale per (token, KV head)
            c = torch.randint(-127, 128, shape, dtype=torch.int8, generator=g)
            c[..., D:] = torch.full((len(perm), BS, HKV, 1), 0.01).view(torch.int8)
            return c
        return torch.rand(shape, generator=g).to(dtype)

    caches = [(cache(), cache()) for _ in range(copies)]
    act = torch.float32 if dtype is torch.int8 else dtype
    qkv = torch.randn(batch, (H + 2 * HKV) * D, generator=g).to(act)
    q, k, v = (x.view(batch, -1, D) for x in qkv.split([H * D, HKV * D, HKV * D], dim=-1))
    plan = build_plan(build_attention_metadata([1] * batch, [context] * batch, tables, BS))
    assert plan.decode is not None and plan.decode.kernel_args is not None
    slots, block_tables, lens = plan.decode.kernel_args
    no_write = torch.full_like(slots, -1)  # attend only: the timed bytes are the reads

    def run_all() -> None:
        for kc, vc in caches:
            assert paged_decode(q, k, v, kc, vc, no_write, block_tables, lens, D**-0.5) is not None

    nbytes = 2 * batch * context * row_bytes
    if ref is None:
        return run.time([Case("this tree", run_all, calls=copies)]), nbytes
    out = torch.empty(batch, H, D)
    kv_format = KV_FORMATS[dtype][0]
    q, k, v = (t.float() for t in (q, k, v))  # what paged_decode hands the kernel

    def direct(lib: ctypes.CDLL) -> Callable[[], None]:
        fn = lib.tq_paged_decode
        fn.argtypes = native.kernel("tq_paged_decode").argtypes
        args = [(q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0), v.stride(0), kc.data_ptr(),
                 vc.data_ptr(), no_write.data_ptr(), block_tables.data_ptr(), lens.data_ptr(), batch,
                 block_tables.shape[1], BS, H, HKV, D, 0, D**-0.5, kv_format, out.data_ptr()) for kc, vc in caches]
        return lambda: [fn(*a) for a in args] and None

    assert ref_name is not None
    cases = [Case("this tree", direct(native.library()), calls=copies), Case(ref_name, direct(ref), calls=copies)]
    return run.time(cases), nbytes


def main() -> None:
    ap = harness.parser(__doc__, repeats=15, threads=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, nargs="+", default=[1000])
    ap.add_argument("--ref", default=None, help="a git ref whose kernels to time beside this tree's")
    args = ap.parse_args()
    run = harness.start(args)
    read, copy = bandwidth(run)
    print(f"read bandwidth {read:.1f} GB/s, copy {copy:.1f} GB/s (read + write)")
    with tempfile.TemporaryDirectory() as tmp:
        ref = harness.build_ref(args.ref, Path(tmp)) if args.ref else None
        table = run.table(["case", "build", "KV MB", "min ms", "med ms", "x30 ms", "GB/s", "floor ms", "% floor",
                           "x this tree (medians)"], title="one layer's decode attention, per call")
        for batch in args.batch:
            for context in args.context:
                for fmt in FORMATS:
                    t, nbytes = kv_case(run, batch, context, fmt, args.ref, ref)
                    floor = nbytes / (read * 1e9)
                    for name in t.names:
                        best, med = t.best(name), t.median(name)
                        table.add([f"b{batch} ctx{context} {fmt}", name, nbytes / 1e6, best * 1e3, med * 1e3,
                                   best * LAYERS * 1e3, nbytes / best / 1e9, floor * 1e3, f"{100 * floor / best:.0f}%",
                                   f"{t.ratio(name, 'this tree'):.2f}"])
    run.finish()


if __name__ == "__main__":
    main()
