"""Cost of structured output per generated token, side by side in one run.

The same prompts, free (ignore_eos) and constrained by a JSON schema whose one long string
field keeps the model writing until max_tokens, so both runs generate the same number of
tokens. Alternating repetitions; medians of seconds per generated token. Run:

    PYTHONPATH=$PWD python benchmarks/structured_overhead.py [model] [--reps 3] [--tokens 64]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from treadle import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 4000}}, "required": ["story"]}


def per_token(llm: LLM, prompts: list[str], params: SamplingParams) -> float:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == len(prompts) * params.max_tokens, tokens  # the same work in both modes
    return elapsed / tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,32")
    args = ap.parse_args()
    llm = LLM(args.model, max_model_len=512, max_num_seqs=64)
    free = SamplingParams(temperature=0.8, seed=0, max_tokens=args.tokens, ignore_eos=True)
    json_params = SamplingParams(temperature=0.8, seed=0, max_tokens=args.tokens,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    per_token(llm, ["warm up"], json_params)  # import xgrammar, build the vocabulary info, compile
    print(f"model {args.model}, {args.tokens} tokens per request, torch threads {torch.get_num_threads()}")
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = [f"Tell story number {i} about a cat." for i in range(batch)]
        runs: dict[str, list[float]] = {"free": [], "json": []}
        for _ in range(args.reps):
            runs["free"].append(per_token(llm, prompts, free))
            runs["json"].append(per_token(llm, prompts, json_params))
        f, j = statistics.median(runs["free"]), statistics.median(runs["json"])
        print(f"batch {batch:3d}: free {f * 1e3:7.2f} ms/token, json schema {j * 1e3:7.2f} ms/token, "
              f"overhead {100 * (j / f - 1):+.1f} %")


if __name__ == "__main__":
    main()
