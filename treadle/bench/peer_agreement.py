"""Greedy agreement with llama.cpp on the same GGUF file (issue 32: Gemma 3 270M Q4_K_M).

    python -m treadle.bench.peer_agreement --model gemma-3-270m --tokens 48 --llama-arg=--no-repack

(``--llama-arg`` goes to llama-server: ``--no-repack`` keeps ggml off its AMX matmul, which dies
with SIGILL on the project's VM; ``--threads`` sets both engines' threads.)

For each prompt (8 texts, and one ~1,500-token prompt whose earlier copy of a passage lies
beyond a 512-token sliding window) both engines continue the same prompt token ids greedily
(EOS ignored). Reported per prompt: the first step where the tokens part, and there llama.cpp's
margin between its token and Treadle's (its logprob of its own token minus its logprob of ours;
llama.cpp rounds activations to 8 bits and keeps KV in f16, so near-ties may part); and,
teacher-forced on llama.cpp's tokens (Treadle's prompt logprobs), the mean |difference| of the
two engines' log-probabilities of those tokens. llama-server comes from tools/build_llamacpp.sh.
"""
from __future__ import annotations

import argparse
import statistics
from typing import NamedTuple

import torch

from treadle import LLM, SamplingParams
from treadle.bench.llamacpp_server import GreedyRun, greedy_logprobs
from treadle.loaders.resolve import resolve_model

TEXTS = [
    "The capital of France is",
    "Once upon a time, there was a little",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "Here is a short poem about the sea:",
    "Question: What is 12 times 7?\nAnswer:",
    "The most important invention of the 20th century was",
]
PASSAGE = ("The lighthouse keeper, Amelia Thorne, logged every ship that passed the northern cape: the Saltwind on "
           "Mondays, the Grey Heron on Thursdays, and once, in the great storm of 1887, a ship with no name at all.")
FILLER = ("Farmers in the valley rotate their crops each season, planting barley, then beans, then letting the "
          "soil rest. Markets open at dawn and close when the bells of the old church ring noon. ")


class PromptResult(NamedTuple):
    prompt_len: int
    first_divergence: int | None  # step index, None when all tokens agree
    margin: float | None  # llama.cpp's logprob(its token) - logprob(ours) at that step (inf: ours not in its top n)
    mean_abs_logprob_diff: float  # teacher-forced on llama.cpp's tokens


def long_prompt(tok: object, target_tokens: int = 1500) -> list[int]:
    """A passage, filler past the window, then the passage's first half again (its copy: beyond the window)."""
    encode = tok.encode  # type: ignore[attr-defined]
    passage, filler = encode(PASSAGE, add_special_tokens=False), encode(FILLER, add_special_tokens=False)
    head = encode("Read the log, then copy it out.\n\n") + passage
    body = filler * ((target_tokens - len(head) - len(passage) // 2) // len(filler) + 1)
    return head + body[: target_tokens - len(head) - len(passage) // 2] + passage[: len(passage) // 2]


def compare(llm: LLM, prompt: list[int], peer: GreedyRun, tokens: int) -> PromptResult:
    greedy = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    ours = list(llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0].outputs[0].token_ids)
    k = next((i for i, (a, b) in enumerate(zip(ours, peer.tokens)) if a != b), None)
    margin = None
    if k is not None:
        top = dict(peer.top[k])
        margin = peer.logprobs[k] - top[ours[k]] if ours[k] in top else float("inf")
    forced = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": prompt + peer.tokens}], forced, use_tqdm=False)[0]
    assert out.prompt_logprobs is not None
    diffs = [abs(out.prompt_logprobs[len(prompt) + i][t].logprob - peer.logprobs[i]) for i, t in enumerate(peer.tokens)]
    return PromptResult(len(prompt), k, margin, statistics.fmean(diffs))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma-3-270m", help="a GGUF short name or path")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--no-long", dest="long", action="store_false", help="skip the ~1,500-token prompt")
    p.add_argument("--llama-arg", action="append", default=[], metavar="ARG",
                   help="an argument for llama-server, repeatable (e.g. --llama-arg=--no-repack)")
    p.add_argument("--threads", type=int, default=None, help="threads of both engines (default: all)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    llm = LLM(str(path), max_model_len=2048)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in TEXTS] + ([long_prompt(tok)] if args.long else [])
    peers = greedy_logprobs(path, prompts, args.tokens, top_n=10, ignore_eos=True, threads=args.threads,
                            extra_args=tuple(args.llama_arg))
    results = [compare(llm, prompt, peer, args.tokens) for prompt, peer in zip(prompts, peers)]
    print(f"{'prompt':>6} {'tokens':>6} {'parts at':>8} {'margin':>7} {'mean |dlogp|':>12}")
    for i, r in enumerate(results):
        parts = "-" if r.first_divergence is None else str(r.first_divergence)
        margin = "-" if r.margin is None else f"{r.margin:.3f}"
        print(f"{i:>6} {r.prompt_len:>6} {parts:>8} {margin:>7} {r.mean_abs_logprob_diff:>12.4f}")
    same = sum(r.first_divergence is None for r in results)
    worst = max((r.margin for r in results if r.margin is not None), default=0.0)
    print(f"identical: {same}/{len(results)}; largest margin at a divergence: {worst:.3f}; "
          f"mean |dlogp| overall: {statistics.fmean(r.mean_abs_logprob_diff for r in results):.4f}")


if __name__ == "__main__":
    main()
