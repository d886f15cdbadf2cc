"""Prompt attention on the CPU: every token a row of the C paged kernel (what the CPU backend does,
so a token's bits do not depend on how its prompt was cut) against torch's SDPA flash prefill
over the gathered context (what it did before), side by side, interleaved, one layer of
SmolLM2-135M's shape (9 query heads, 3 KV heads, head_dim 64), float32 cache.

    .venv/bin/python benchmarks/prefill_attention_cpu.py --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from treadle.layers.attention import build_attention_metadata
from treadle.layers.attention.backend import AttentionSpec
from treadle.layers.attention.cpu import DECODE_ROWS_MAX, CPUBackend, build_plan

H, HKV, D, BS = 9, 3, 64, 16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = AttentionSpec(H, HKV, D, D ** -0.5)
    backend = CPUBackend()
    print(f"threads {args.threads}; ms per layer call, median of {args.repeats} (rows = C kernel, sdpa = before)")
    for context, q_len in [(0, 512), (0, 128), (384, 128), (1024, 512)]:
        seq = context + q_len
        blocks = list(range(1, -(-seq // BS) + 1))
        cache = [torch.randn(len(blocks) + 1, BS, HKV, D) for _ in range(2)]
        meta = build_attention_metadata([q_len], [seq], [blocks], BS)
        q, k, v = torch.randn(q_len, H, D), torch.randn(q_len, HKV, D), torch.randn(q_len, HKV, D)
        plans = {"rows": build_plan(meta), "sdpa": build_plan(meta, DECODE_ROWS_MAX)}
        times: dict[str, list[float]] = {name: [] for name in plans}
        for _ in range(args.repeats + 1):
            for name, plan in plans.items():
                meta.plan = plan
                t = time.perf_counter()
                backend.forward(q, k, v, cache[0], cache[1], meta, spec)
                times[name].append(time.perf_counter() - t)
        rows, sdpa = (statistics.median(times[n][1:]) * 1e3 for n in ("rows", "sdpa"))
        print(f"context {context:5d} + {q_len:4d} new: rows {rows:7.3f}  sdpa {sdpa:7.3f}  ratio {rows / sdpa:5.2f}")


if __name__ == "__main__":
    main()
