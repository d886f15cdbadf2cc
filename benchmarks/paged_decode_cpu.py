"""Decode attention on the CPU: the torch path (index_copy_ K/V write + flash_decode) vs the
C kernel (paged_decode, which also writes K/V), SmolLM2-135M's shapes (9 query heads, 3 KV
heads, head_dim 64, block 16). Times are per layer; "x30" is a whole 30-layer decode step.

Each timed pass walks several separate caches (>= 96 MB in all, more than the L3), as the
layers of a real step do, so the KV cache is read from memory rather than from a warm cache.

Run: .venv/bin/python benchmarks/paged_decode_cpu.py [threads]
Medians of interleaved repeats in one process (the machine may be shared).
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from treadle.kernels.attention import paged_decode
from treadle.layers.attention import AttentionSpec, build_attention_metadata
from treadle.layers.attention.cpu import _write_kv, build_plan, flash_decode

H, HKV, D, BS, LAYERS = 9, 3, 64, 16, 30
COLD_BYTES = 96 << 20


def time_case(batch: int, context: int, repeats: int = 5) -> tuple[float, float]:
    """(torch ms, C ms) per layer: medians over interleaved repeats."""
    g = torch.Generator().manual_seed(0)
    need = -(-context // BS)
    perm = torch.randperm(batch * need + 4, generator=g).tolist()
    tables = [perm[i * need : (i + 1) * need] for i in range(batch)]
    shape = (len(perm), BS, HKV, D)
    copies = max(1, min(64, -(-COLD_BYTES // (2 * 4 * torch.Size(shape).numel()))))
    caches = [(torch.rand(shape, generator=g), torch.rand(shape, generator=g)) for _ in range(copies)]
    qkv = torch.randn(batch, (H + 2 * HKV) * D, generator=g)  # strided views, as in the model
    q, k, v = (x.view(batch, -1, D) for x in qkv.split([H * D, HKV * D, HKV * D], dim=-1))
    plan = build_plan(build_attention_metadata([1] * batch, [context] * batch, tables, BS))
    dec, spec = plan.decode, AttentionSpec(H, HKV, D, D**-0.5)
    assert dec is not None and dec.kernel_args is not None

    def torch_path() -> None:
        for kc, vc in caches:
            _write_kv(k, v, kc, vc, plan)
            flash_decode(q, kc, vc, dec, spec)

    def c_path() -> None:
        for kc, vc in caches:
            paged_decode(q, k, v, kc, vc, *dec.kernel_args, spec.scale)

    passes = max(3, 400 // (copies * max(1, batch * context // 2048)))
    results: dict[str, list[float]] = {"torch": [], "c": []}
    for _ in range(repeats):  # interleave to share the machine's noise
        for name, fn in (("torch", torch_path), ("c", c_path)):
            times = []
            for _ in range(passes):
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) / copies)
            results[name].append(statistics.median(times) * 1e3)
    return statistics.median(results["torch"]), statistics.median(results["c"])


def main() -> None:
    if len(sys.argv) > 1:
        torch.set_num_threads(int(sys.argv[1]))
    print(f"threads={torch.get_num_threads()}  per layer (x30 = one SmolLM2-135M decode step)")
    print(f"{'case':14s} {'torch ms':>9s} {'C ms':>8s} {'torch x30':>10s} {'C x30':>8s} {'speedup':>8s}")
    for batch in (1, 8, 32):
        for context in (256, 1024):
            t, c = time_case(batch, context)
            name = f"b{batch} ctx{context}"
            print(f"{name:14s} {t:9.4f} {c:8.4f} {t * LAYERS:10.3f} {c * LAYERS:8.3f} {t / c:7.1f}x")


if __name__ == "__main__":
    main()
