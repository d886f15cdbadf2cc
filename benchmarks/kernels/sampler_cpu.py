"""What sampling costs on the CPU: per row (the sampler alone, on logits of SmolLM2's width) and
end to end (decode tokens/s, greedy against temperature 0.8 / top_p 0.95, same engine).

    .venv/bin/python benchmarks/kernels/sampler_cpu.py --threads 2
    PYTHONPATH=$OTHER_CHECKOUT .venv/bin/python benchmarks/kernels/sampler_cpu.py ...   # another version

Random logits (normal, std 3) keep thousands of tokens under top_p 0.95: the slow case for
top-p; a chat model's rows are peaked and keep a few.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import harness
import torch
from harness import Case, Run

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


def per_row(run: Run, batch: int, vocab: int) -> None:
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)) * 3
    sampler = Sampler(0)
    cases = [Case(name, partial(sampler, logits, [SamplingRow(params, list(range(200)), list(range(50)), (2,))
                                                  for _ in range(batch)])) for name, params in CASES.items()]
    t = run.time(cases)
    run.table(["params", "ms per call", "us per row", "x greedy"],
              [[name, t.median(name) * 1e3, t.median(name) / batch * 1e6, f"{t.ratio(name, 'greedy'):.2f}"]
               for name in t.names], title=f"sampler alone, {batch} rows of {vocab} random logits, median of {run.args.repeats}")


def end_to_end(run: Run, batches: list[int], tokens: int) -> None:
    llm = LLM("smollm2-135m-instruct")
    table = run.table(["batch", "params", "tok/s"], digits=1,
                      title=f"decode, SmolLM2-135M-Instruct, 32-token prompts, {tokens} new tokens (second of two runs)")
    for b in batches:
        prompts = [{"prompt_token_ids": [100 + (i * 7 + j) % 1000 for j in range(32)]} for i in range(b)]
        cases = []
        for name, params in (("greedy", SamplingParams(temperature=0.0)),
                             ("t 0.8, top_p 0.95", SamplingParams(temperature=0.8, top_p=0.95, seed=1))):
            params = dataclasses.replace(params, max_tokens=tokens, ignore_eos=True)
            cases.append(Case(name, partial(llm.generate, prompts, params, use_tqdm=False)))
        t = run.time(cases, repeats=1, warmup=1)  # the second of two runs, the two kinds in turn
        for name in t.names:
            table.add([b, name, b * tokens / t.median(name)])


def main() -> None:
    ap = harness.parser(__doc__, repeats=20, threads=None, clock="wall")
    ap.add_argument("--batch", type=int, default=16, help="rows per sampler call")
    ap.add_argument("--decode-batches", type=int, nargs="*", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    run = harness.start(args)
    per_row(run, args.batch, 49152)
    if args.decode_batches:
        end_to_end(run, args.decode_batches, args.tokens)
    run.finish()


if __name__ == "__main__":
    main()
