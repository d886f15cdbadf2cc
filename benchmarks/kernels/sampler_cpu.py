"""What sampling costs on the CPU: per row (the sampler alone, on logits of SmolLM2's width) and
end to end (decode tokens/s, greedy against temperature 0.8 / top_p 0.95, same engine).

    .venv/bin/python benchmarks/sampler_cpu.py --threads 2
    PYTHONPATH=$OTHER_CHECKOUT .venv/bin/python benchmarks/sampler_cpu.py ...   # another version

Random logits (normal, std 3) keep thousands of tokens under top_p 0.95: the slow case for
top-p; a chat model's rows are peaked and keep a few.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from treadle import LLM, SamplingParams
from treadle.sample.sampler import Sampler, SamplingRow

CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 1": SamplingParams(temperature=1.0),
    "t 0.8, top_p 0.95": SamplingParams(temperature=0.8, top_p=0.95),
    "t 0.8, top_k 50": SamplingParams(temperature=0.8, top_k=50),
    "t 0.8, min_p 0.05": SamplingParams(temperature=0.8, min_p=0.05),
    "greedy, repetition 1.1": SamplingParams(temperature=0.0, repetition_penalty=1.1),
}


def per_row(batch: int, vocab: int, repeats: int) -> None:
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)) * 3
    sampler = Sampler(0)
    print(f"sampler alone, {batch} rows of {vocab} random logits, median of {repeats}:")
    for name, params in CASES.items():
        rows = [SamplingRow(params, list(range(200)), list(range(50)), (2,)) for _ in range(batch)]
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            sampler(logits, rows)
            times.append(time.perf_counter() - t)
        t = sorted(times)[len(times) // 2]
        print(f"  {name:24s} {t * 1e3:8.2f} ms per call, {t / batch * 1e6:8.1f} us per row")


def end_to_end(batches: list[int], tokens: int) -> None:
    llm = LLM("smollm2-135m-instruct")
    print(f"decode, SmolLM2-135M-Instruct, 32-token prompts, {tokens} new tokens (second of two runs):")
    for b in batches:
        prompts = [{"prompt_token_ids": [100 + (i * 7 + j) % 1000 for j in range(32)]} for i in range(b)]
        for name, params in (("greedy", SamplingParams(temperature=0.0)),
                             ("t 0.8, top_p 0.95", SamplingParams(temperature=0.8, top_p=0.95, seed=1))):
            params = dataclasses.replace(params, max_tokens=tokens, ignore_eos=True)
            llm.generate(prompts, params, use_tqdm=False)
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            print(f"  batch {b:3d} {name:20s} {b * tokens / (time.perf_counter() - t):8.1f} tok/s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batch", type=int, default=16, help="rows per sampler call")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--decode-batches", type=int, nargs="*", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    per_row(args.batch, 49152, args.repeats)
    if args.decode_batches:
        end_to_end(args.decode_batches, args.tokens)


if __name__ == "__main__":
    main()
