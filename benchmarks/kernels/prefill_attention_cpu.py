"""Prompt attention on the CPU: every token a row of the C paged kernel (what the CPU backend does,
so a token's bits do not depend on how its prompt was cut) against torch's SDPA flash prefill
over the gathered context (what it did before), side by side, interleaved, one layer of
SmolLM2-135M's shape (9 query heads, 3 KV heads, head_dim 64), float32 cache.

    .venv/bin/python benchmarks/kernels/prefill_attention_cpu.py --threads 2
"""
from __future__ import annotations

from collections.abc import Callable

import harness
import torch
from harness import Case

from treadle.layers.attention import AttentionMetadata, build_attention_metadata
from treadle.layers.attention.backend import AttentionSpec
from treadle.layers.attention.cpu import DECODE_ROWS_MAX, CPUBackend, build_plan
from treadle.layers.attention.metadata import StepPlan

H, HKV, D, BS = 9, 3, 64, 16


def use_plan(meta: AttentionMetadata, plan: StepPlan) -> Callable[[], None]:
    def switch() -> None:
        meta.plan = plan
    return switch


def main() -> None:
    ap = harness.parser(__doc__, repeats=15, threads=2, clock="wall")
    args = ap.parse_args()
    run = harness.start(args)
    spec = AttentionSpec(H, HKV, D, D ** -0.5)
    backend = CPUBackend()
    table = run.table(["context", "new", "rows ms", "sdpa ms", "rows / sdpa"],
                      title="ms per layer call, median (rows = C kernel, sdpa = before)")
    for context, q_len in [(0, 512), (0, 128), (384, 128), (1024, 512)]:
        seq = context + q_len
        blocks = list(range(1, -(-seq // BS) + 1))
        cache = [torch.randn(len(blocks) + 1, BS, HKV, D) for _ in range(2)]
        meta = build_attention_metadata([q_len], [seq], [blocks], BS)
        q, k, v = torch.randn(q_len, H, D), torch.randn(q_len, HKV, D), torch.randn(q_len, HKV, D)
        plans = {"rows": build_plan(meta), "sdpa": build_plan(meta, DECODE_ROWS_MAX)}
        def layer(q=q, k=k, v=v, cache=cache, meta=meta) -> None:  # noqa: ANN001
            backend.forward(q, k, v, cache[0], cache[1], meta, spec)

        t = run.time([Case(name, layer, before=use_plan(meta, plan)) for name, plan in plans.items()])
        table.add([context, q_len, t.median("rows") * 1e3, t.median("sdpa") * 1e3, f"{t.ratio('rows', 'sdpa'):.2f}"])
    run.finish()


if __name__ == "__main__":
    main()
