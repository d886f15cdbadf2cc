"""Does torch.compile speed up a decode step on the CPU? Eager vs compiled, side by side.

    .venv/bin/python benchmarks/compile_decode_cpu.py [--quantization none|auto] [--threads N]

Times the model forward + logits of a batch-1 decode step (context 64) on SmolLM2-135M,
first eager, then under ``torch.compile(dynamic=True)`` (compile time reported apart),
interleaved rounds, medians. Treadle does not compile by default: on float weights the
measured gain is below the compile cost and guard overhead, and the native GGUF path calls C
kernels through ctypes, which torch.compile cannot trace (each call is a graph break).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from treadle.layers.attention import build_attention_metadata
from treadle.layers.attention.cpu import CPUBackend
from treadle.loaders import load_model

BLOCK = 16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model("smollm2-135m-instruct", CPUBackend(), quantization=args.quantization)
    cfg, model = lm.config, lm.model
    context = 64
    shape = (-(-(context + 4 * args.steps + 8) // BLOCK), BLOCK, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
    table = [list(range(shape[0]))]

    def forward(ids: torch.Tensor, pos: torch.Tensor, meta) -> torch.Tensor:  # noqa: ANN001
        return model.compute_logits(model(ids, pos, caches, meta))

    with torch.no_grad():
        meta = build_attention_metadata([context], [context], table, BLOCK)
        meta.plan = model.backend.plan(meta)
        forward(torch.arange(context) + 100, torch.arange(context), meta)
        compiled = torch.compile(forward, dynamic=True)
        pos = context

        def step(fn) -> float:  # noqa: ANN001
            nonlocal pos
            meta = build_attention_metadata([1], [pos + 1], table, BLOCK)
            t = time.perf_counter()
            meta.plan = model.backend.plan(meta)  # once per step, as the runner does
            fn(torch.tensor([100]), torch.tensor([pos]), meta)
            pos += 1
            return time.perf_counter() - t

        t = time.perf_counter()
        step(compiled)
        step(compiled)
        compile_s = time.perf_counter() - t
        eager, comp = [], []
        for _ in range(args.steps):
            eager.append(step(forward))
            comp.append(step(compiled))
    e, c = statistics.median(eager) * 1e3, statistics.median(comp) * 1e3
    print(f"quantization {args.quantization}, threads {torch.get_num_threads()}: eager {e:.2f} ms, "
          f"compiled {c:.2f} ms ({e / c:.2f}x), first two compiled steps {compile_s:.1f} s")


if __name__ == "__main__":
    main()
