"""A prompt's prefill timed in several kernel builds, interleaved in one process: one engine per
build (each loaded under its ``TREADLE_CPU_KERNELS``, which its fused decoder layers keep; the
variable is set again before each prompt for the kernels called per call), random prompts of the
same length alternated between them, process CPU time per prompt (so other jobs on a shared
machine disturb it less than ``treadle bench latency``'s wall-clock TTFT), one thread by default.

    .venv/bin/python benchmarks/prefill_builds_ab.py --model FILE.gguf --builds amx avx512-bf16 avx512-vnni \\
        [--input-len 512] [--rounds 5] [--threads 1] [--activation-bits 8]

Round 0 warms every build and is not counted; the last build named is the baseline of the ratios.
Prefix caching is off (every prompt is new anyway).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--builds", nargs="+", required=True, help="TREADLE_CPU_KERNELS names; the last is the baseline")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--activation-bits", default="8", choices=["8", "16"])
    args = ap.parse_args()
    os.environ["TREADLE_ACTIVATION_BITS"] = args.activation_bits
    import torch

    torch.set_num_threads(args.threads)
    from treadle import LLM, SamplingParams

    llms = {}
    for build in args.builds:
        os.environ["TREADLE_CPU_KERNELS"] = build
        llms[build] = LLM(args.model, max_model_len=2 * args.input_len, enable_prefix_caching=False)
    vocab = llms[args.builds[0]].get_tokenizer().vocab_size
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    cpu: dict[str, list[float]] = {b: [] for b in args.builds}
    for r in range(args.rounds + 1):
        for build in args.builds:
            os.environ["TREADLE_CPU_KERNELS"] = build
            prompt = {"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(args.input_len)]}
            t0, w0 = time.process_time(), time.perf_counter()
            llms[build].generate(prompt, params, use_tqdm=False)
            t, w = time.process_time() - t0, time.perf_counter() - w0
            if r:
                cpu[build].append(t)
            print(f"round {r} {build}: cpu {t * 1e3:.0f} ms, wall {w * 1e3:.0f} ms", flush=True)
    base = statistics.median(cpu[args.builds[-1]])
    print(f"\n| build | prefill CPU ms (median of {args.rounds}) | min-max | x {args.builds[-1]} |\n|---|---|---|---|")
    for build in args.builds:
        med = statistics.median(cpu[build])
        print(f"| {build} | {med * 1e3:.0f} | {min(cpu[build]) * 1e3:.0f}-{max(cpu[build]) * 1e3:.0f} | {base / med:.2f} |")


if __name__ == "__main__":
    main()
