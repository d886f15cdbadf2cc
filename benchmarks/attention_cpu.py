"""Side-by-side timing of CPUBackend vs ReferenceBackend (SmolLM2-135M head shape).

Run: .venv/bin/python benchmarks/attention_cpu.py [threads]
Medians of interleaved repeats in one process (the machine may be shared).
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from treadle.layers.attention import AttentionSpec, ReferenceBackend, build_attention_metadata
from treadle.layers.attention.cpu import CPUBackend

H, HKV, D, BS = 9, 3, 64, 16


def case(query_lens: list[int], seq_lens: list[int]):
    g = torch.Generator().manual_seed(0)
    need = [-(-s // BS) for s in seq_lens]
    perm = torch.randperm(sum(need) + 4, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    kc = torch.randn(len(perm), BS, HKV, D, generator=g)
    vc = torch.randn_like(kc)
    n = sum(query_lens)
    q, k, v = (torch.randn(n, h, D, generator=g) for h in (H, HKV, HKV))
    meta = build_attention_metadata(query_lens, seq_lens, tables, BS)
    meta.plan = CPUBackend().plan(meta)  # once per step, as the runner does
    return q, k, v, kc, vc, meta, AttentionSpec(H, HKV, D, D**-0.5)


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    if len(sys.argv) > 1:  # optional thread count, e.g. 1 when the machine is shared
        torch.set_num_threads(int(sys.argv[1]))
    cases = {
        "decode b1 ctx128": ([1], [128]),
        "decode b1 ctx1024": ([1], [1024]),
        "decode b1 ctx4096": ([1], [4096]),
        "decode b8 ctx512": ([1] * 8, [512] * 8),
        "decode b32 ctx256": ([1] * 32, [256] * 32),
        "prefill 512": ([512], [512]),
        "chunk 256 after 768": ([256], [1024]),
        "mixed 128-chunk + 8 decodes": ([128] + [1] * 8, [384] + [300] * 8),
    }
    cpu, ref = CPUBackend(), ReferenceBackend()
    print(f"threads={torch.get_num_threads()}")
    print(f"{'case':32s} {'ref ms':>8s} {'cpu ms':>8s} {'speedup':>8s}")
    for name, (ql, sl) in cases.items():
        args = case(ql, sl)
        reps = 30 if max(ql) == 1 else 8
        r_all, c_all = [], []
        for _ in range(3):  # interleave to share the machine's noise
            r_all.append(median_ms(lambda a=args: ref.forward(*a), reps))
            c_all.append(median_ms(lambda a=args: cpu.forward(*a), reps))
        r, c = statistics.median(r_all), statistics.median(c_all)
        print(f"{name:32s} {r:8.3f} {c:8.3f} {r / c:7.2f}x")


if __name__ == "__main__":
    main()
