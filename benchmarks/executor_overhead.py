"""What the mp executor's process boundary costs per step, side by side with the in-process one.

Runs the same decode workload through ``distributed_executor_backend="uni"`` and ``"mp"`` (one
worker), alternating rounds so that machine noise hits both alike, and prints the median
engine step time of each and their difference (the pyzmq + msgpack round trip).

    python benchmarks/executor_overhead.py --model stories260k --batch 8 --steps 64 --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from treadle import LLM, SamplingParams


def decode_step_times(llm: LLM, batch: int, steps: int, round_id: int) -> list[float]:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{round_id}-{i}", {"prompt_token_ids": [1 + (7 * i + j) % 400 for j in range(32)]}, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()  # prefill
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="stories260k")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llms = {b: LLM(args.model, distributed_executor_backend=b, kv_cache_memory="256MiB") for b in ("uni", "mp")}
    times: dict[str, list[float]] = {b: [] for b in llms}
    try:
        for r in range(args.rounds):
            for name, llm in llms.items():
                times[name] += decode_step_times(llm, args.batch, args.steps, r)
    finally:
        for llm in llms.values():
            llm.shutdown()
    med = {b: statistics.median(t) * 1e3 for b, t in times.items()}
    print(f"{args.model}, batch {args.batch}, {args.threads} thread(s), {len(times['uni'])} decode steps each")
    print("| executor | median step ms |\n|---|---|")
    for name, ms in med.items():
        print(f"| {name} | {ms:.3f} |")
    print(f"mp - uni: {med['mp'] - med['uni']:+.3f} ms per step ({med['mp'] / med['uni']:.2f}x)")


if __name__ == "__main__":
    main()
