"""Mean acceptance length of draft heads vs n-gram on held-out prompts (greedy, K drafts,
fallback off), and a check that every method's output equals plain decoding.

    python benchmarks/draft_head_acceptance.py --model stories260k \
        --prompts benchmarks/prompts/stories_heldout.txt --max-tokens 100 -k 4
"""
from __future__ import annotations

import argparse
import time

import torch

from treadle import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="stories260k")
    ap.add_argument("--prompts", default="benchmarks/prompts/stories_heldout.txt")
    ap.add_argument("--max-tokens", type=int, default=100)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--heads", nargs="*", default=[], metavar="METHOD=DIR",
                    help="eagle=DIR / medusa=DIR (default: the model's shipped heads)")
    ap.add_argument("--chat", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    prompts = [line.strip() for line in open(args.prompts) if line.strip()]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    heads = dict(h.split("=", 1) for h in args.heads) or {"eagle": None, "medusa": None}

    def gen(llm: LLM) -> list[list[int]]:
        outs = (llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False) if args.chat
                else llm.generate(prompts, params, use_tqdm=False))
        return [o.outputs[0].token_ids for o in outs]

    plain = gen(LLM(args.model))
    print(f"{len(prompts)} prompts, {args.max_tokens} tokens, K={args.k}")
    print("| method | mean acceptance length | accepted by position | identical to plain | s |")
    print("|---|---|---|---|---|")
    for method, head in [("ngram", None), *heads.items()]:
        cfg: dict[str, object] = {"method": method, "num_speculative_tokens": args.k, "fallback": False}
        if head:
            cfg["model"] = head
        llm = LLM(args.model, speculative_config=cfg)
        t = time.perf_counter()
        out = gen(llm)
        st = llm.get_stats()["spec_decode"]
        print(f"| {method} | {st['mean_acceptance_length']:.2f} | {st['accepted_per_position']} | {out == plain} "
              f"| {time.perf_counter() - t:.1f} |")


if __name__ == "__main__":
    main()
