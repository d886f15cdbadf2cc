"""Decode-step time of a GGUF model with 16-bit and with 8-bit activations (``TREADLE_ACTIVATION_BITS``),
two engines in one process, their steps interleaved so both see the same machine load.

    .venv/bin/python benchmarks/activation_bits_cpu.py --batch 1 4 16 --threads 2

Each engine prefills ``--batch`` prompts of ``--prompt-len`` tokens, then both take ``--steps``
decode steps in turn (the variable is set before each step: the fused layers read their layout
at load, the lm_head at each call). Prints the median step per setting and batch, and each
setting's step at batch B over its batch-1 step when batch 1 is among the sizes.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from profile_decode import TimedBackend, time_decode_step

from treadle import LLM, SamplingParams

BITS = ("16", "8")


def engines(model: str, batch: int, prompt_len: int, steps: int) -> dict[str, tuple]:
    out = {}
    for bits in BITS:
        os.environ["TREADLE_ACTIVATION_BITS"] = bits
        llm = LLM(model, kv_cache_memory="256MiB")
        eng = llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
        for i in range(batch):
            eng.add_request(str(i), {"prompt_token_ids": [100 + (i + j) % 1000 for j in range(prompt_len)]}, params)
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
            eng.step()  # prefill
        out[bits] = (llm, eng, TimedBackend(eng.model_runner().backend))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    saved = os.environ.get("TREADLE_ACTIVATION_BITS")
    median: dict[tuple[str, int], float] = {}
    try:
        for batch in args.batch:
            engs = engines(args.model, batch, args.prompt_len, args.steps)
            samples: dict[str, list[float]] = {b: [] for b in BITS}
            for _ in range(args.steps):
                for bits, (_, eng, timed) in engs.items():
                    os.environ["TREADLE_ACTIVATION_BITS"] = bits
                    samples[bits].append(time_decode_step(eng, timed, time.perf_counter)[-1])
            for bits in BITS:
                median[bits, batch] = statistics.median(samples[bits]) * 1e3
            del engs
    finally:
        if saved is None:
            os.environ.pop("TREADLE_ACTIVATION_BITS", None)
        else:
            os.environ["TREADLE_ACTIVATION_BITS"] = saved
    print(f"{args.model}, prompt {args.prompt_len}, {args.threads} threads, median decode step (wall ms)")
    print("| batch | 16-bit | 8-bit | 8-bit / 16-bit |")
    print("|---|---|---|---|")
    for batch in args.batch:
        a, b = median["16", batch], median["8", batch]
        ratio = (f" ({a / median['16', 1]:.2f}x / {b / median['8', 1]:.2f}x batch 1)"
                 if 1 in args.batch and batch != 1 else "")
        print(f"| {batch} | {a:.2f} | {b:.2f} | {b / a:.3f}{ratio} |")


if __name__ == "__main__":
    main()
