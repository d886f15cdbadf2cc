"""The fused C decoder stack against the module path on one engine, steps interleaved
(A B A B ...), each step's thread CPU time and wall time: on a shared machine only the
interleaved ratio means much.

    .venv/bin/python benchmarks/fused_stack_ab.py --model gemma-3-270m --context 64 --steps 40 --threads 1

Batch 1, greedy; the request is prefilled to ``--context`` tokens first. Prints medians per
path and the ratio (module / fused: above 1, the fused stack is faster).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from treadle import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40, help="decode steps per path")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, max_model_len=args.context + 2 * args.steps + 8)
    eng = llm.engine
    model = eng.model_runner().model
    fused = model.decoder
    fallback = getattr(fused, "fallback", None)
    if fallback is None:
        raise SystemExit(f"{args.model}: no fused decoder stack on this machine / model")
    prompt = [2] + [(i * 37) % 5000 + 100 for i in range(args.context - 1)]
    params = SamplingParams(temperature=0.0, max_tokens=2 * args.steps + 2, ignore_eos=True)
    eng.add_request(None, {"prompt_token_ids": prompt}, params)
    eng.step()  # the prompt
    times: dict[str, list[tuple[float, float]]] = {"fused": [], "module": []}
    for i in range(2 * args.steps):
        name = ("fused", "module")[i % 2]
        model.decoder = fused if name == "fused" else fallback
        c, w = time.thread_time(), time.perf_counter()
        eng.step()
        times[name].append((time.thread_time() - c, time.perf_counter() - w))
    model.decoder = fused
    med = {k: (statistics.median(c for c, _ in v) * 1e3, statistics.median(w for _, w in v) * 1e3)
           for k, v in times.items()}
    for k, (c, w) in med.items():
        print(f"{k:7s} step: {c:6.2f} ms thread CPU, {w:6.2f} ms wall (median of {args.steps})")
    print(f"module / fused: {med['module'][0] / med['fused'][0]:.3f}x CPU, {med['module'][1] / med['fused'][1]:.3f}x wall")


if __name__ == "__main__":
    main()
