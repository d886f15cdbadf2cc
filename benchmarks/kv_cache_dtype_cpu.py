"""Decode step time with the KV cache in the model's dtype vs int8 / fp8, side by side.

Each engine (one per ``--kv-cache-dtype``) gets the same batch of requests with long prompts;
after their prefills, decode steps (one new token per request) are timed, the engines taking
turns block by block so they share the machine's noise. Reports the median step per engine and
the ratio to the first. The KV cache memory each holds is printed too (same token capacity in
less memory: the quantized caches are smaller).

    .venv/bin/python benchmarks/kv_cache_dtype_cpu.py --model smollm2-135m-instruct --batch 16 \
        --prompt-len 1000 --steps 24 [--kv auto int8 fp8] [--threads N] [--no-fused-layers]

The C decode kernel alone over each cache dtype (no engine, no prefill) is
benchmarks/kernels/kv_decode_dtypes_cpu.py.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from treadle import LLM, SamplingParams


def start(model: str, kv: str, batch: int, prompt_len: int, steps: int, fused: bool) -> LLM:
    blocks = batch * (-(-(prompt_len + steps + 16) // 16))
    llm = LLM(model, kv_cache_dtype=kv, num_kv_blocks=blocks, block_size=16, max_num_seqs=batch,
              max_num_batched_tokens=2048, fused_layers=fused, enable_prefix_caching=False)
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps * 2 + 8, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        prompt = torch.randint(10, 400, (prompt_len,), generator=g).tolist()
        eng.add_request(str(i), {"prompt_token_ids": prompt}, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
        eng.step()  # prefill
    return llm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--kv", nargs="+", default=["auto", "int8", "fp8"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-fused-layers", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engines = {}
    for kv in args.kv:
        t = time.perf_counter()
        engines[kv] = start(args.model, kv, args.batch, args.prompt_len, args.steps, not args.no_fused_layers)
        print(f"kv {kv}: started and prefilled in {time.perf_counter() - t:.0f} s", flush=True)
    times: dict[str, list[float]] = {kv: [] for kv in args.kv}
    for _ in range(args.steps // 4):  # blocks of 4 steps per engine, in turn
        for kv, llm in engines.items():
            for _ in range(4):
                t = time.perf_counter()
                llm.engine.step()
                times[kv].append(time.perf_counter() - t)
    base = statistics.median(times[args.kv[0]])
    print(f"model {args.model}, batch {args.batch}, context ~{args.prompt_len}, threads {torch.get_num_threads()}, "
          f"fused layers {not args.no_fused_layers}")
    print(f"{'kv_cache_dtype':>14} {'KV MiB':>8} {'step ms (median)':>17} {'ratio':>6}")
    for kv, llm in engines.items():
        cfg = llm.engine.config.cache
        mib = cfg.num_blocks * cfg.bytes_per_block / (1 << 20)
        med = statistics.median(times[kv])
        print(f"{cfg.kv_cache_dtype:>14} {mib:8.1f} {med * 1e3:17.1f} {med / base:6.2f}")


if __name__ == "__main__":
    main()
