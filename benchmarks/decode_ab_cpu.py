"""A/B of one CPU decode-path feature: two SmolLM2 engines in one process, one with the feature
and one without, their decode steps interleaved so both see the same machine load.

    .venv/bin/python benchmarks/decode_ab_cpu.py --feature packing --batch 1 4   # 8-bit activations
    .venv/bin/python benchmarks/decode_ab_cpu.py --feature stack --batch 1 4

Features:
  packing  Q4_0/Q4_1 rows packed at load for 8-bit activations (GGUFBlockMethod's
           process_weights_after_loading); "without" loads the file's layout. Sets
           TREADLE_ACTIVATION_BITS=8.
  stack    the whole fused layer stack as one C call per step (model.fused_stack); "without"
           calls the fused layers one by one. Uses TREADLE_ACTIVATION_BITS as set.

Each engine prefills ``--batch`` prompts of ``--prompt-len`` tokens, then both take ``--steps``
decode steps in turn. Prints the median step of each and their ratio.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from profile_decode import TimedBackend, time_decode_step

from treadle import LLM, SamplingParams
from treadle.quantization import gguf_native


def engine(model: str, feature: str, on: bool, batch: int, prompt_len: int, steps: int) -> tuple:
    method = gguf_native.GGUFBlockMethod
    hook = method.process_weights_after_loading
    if feature == "packing" and not on:
        method.process_weights_after_loading = lambda self, layer: None  # type: ignore[method-assign]
    try:
        llm = LLM(model, kv_cache_memory="512MiB")
    finally:
        method.process_weights_after_loading = hook  # type: ignore[method-assign]
    eng = llm.engine
    if feature == "stack" and not on:
        eng.model_runner().model.fused_stack = None
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        eng.add_request(str(i), {"prompt_token_ids": [100 + (i + j) % 1000 for j in range(prompt_len)]}, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
        eng.step()  # prefill
    return llm, eng, TimedBackend(eng.model_runner().backend)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--feature", choices=["packing", "stack"], required=True)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.feature == "packing":
        os.environ["TREADLE_ACTIVATION_BITS"] = "8"
    print(f"{args.model}, {args.feature}, prompt {args.prompt_len}, {args.threads} threads, "
          f"TREADLE_ACTIVATION_BITS={os.environ.get('TREADLE_ACTIVATION_BITS', '16')}, median decode step (wall ms)")
    print("| batch | without | with | speedup |")
    print("|---|---|---|---|")
    for batch in args.batch:
        engs = {on: engine(args.model, args.feature, on, batch, args.prompt_len, args.steps) for on in (False, True)}
        samples: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.steps):
            for on, (_, eng, timed) in engs.items():
                samples[on].append(time_decode_step(eng, timed, time.perf_counter)[-1])
        off, on_ = (statistics.median(samples[k]) * 1e3 for k in (False, True))
        print(f"| {batch} | {off:.2f} | {on_:.2f} | {off / on_:.3f}x |", flush=True)
        del engs


if __name__ == "__main__":
    main()
