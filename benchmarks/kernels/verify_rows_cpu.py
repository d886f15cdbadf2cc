"""What a speculative verify step costs against a plain decode step: one sequence's forward
with 1, 2, ... query rows at the end of a context (the rows a verify of K drafts runs: 1 + K),
layers (the one-call C layer takes up to ``DECODE_ROWS_MAX`` rows) and lm_head timed apart,
interleaved over repeats, medians (thread CPU time with one thread, so other jobs on a shared
machine disturb it less; wall time with more). ``PYTHONPATH=<other checkout>`` times that tree.

    python benchmarks/verify_rows_cpu.py --model smollm2-135m-instruct --threads 1

The ratio bounds what speculation can give at batch 1: with mean acceptance length L (tokens
per verify) and a verify of 1 + K rows costing r(1 + K) plain steps, the speed-up is at most
L / r(1 + K), and L <= 1 + K.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from treadle import LLM
from treadle.layers.attention import StepInputBuilder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=200, help="tokens already in the cache")
    ap.add_argument("--rows", default="1,2,3,5,8,9,13,16")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    rows = [int(r) for r in args.rows.split(",")]
    llm = LLM(args.model, max_model_len=args.context + max(rows) + 16, kv_cache_memory="64MiB")
    runner = llm.engine.model_runner()
    model, kv = runner.model, runner.kv_caches
    builder = StepInputBuilder(runner.block_size)
    table = list(range(-(-(args.context + max(rows)) // runner.block_size)))
    times: dict[int, tuple[list[float], list[float]]] = {q: ([], []) for q in rows}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for q in rows:
                positions, meta = builder.build([q], [args.context + q], [table])
                meta.plan = model.backend.plan(meta)
                ids = torch.randint(100, model.config.vocab_size, (q,))
                t0 = clock()
                hidden = model(ids, positions, kv, meta)
                t1 = clock()
                model.compute_logits(hidden)
                times[q][0].append(t1 - t0)
                times[q][1].append(clock() - t1)
    med = {q: (statistics.median(a) * 1e3, statistics.median(b) * 1e3) for q, (a, b) in times.items()}
    plain = sum(med[rows[0]])
    print(f"| rows | layers ms | lm_head ms | step / {rows[0]}-row step |\n|---|---|---|---|")
    for q in rows:
        print(f"| {q} | {med[q][0]:.1f} | {med[q][1]:.1f} | {sum(med[q]) / plain:.2f} |")


if __name__ == "__main__":
    main()
