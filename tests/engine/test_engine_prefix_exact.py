"""A prefix-cache hit, a chunked prompt and a whole prompt give the same bits (issue 34, fault 8).

A prompt computed after a hit of 1..N blocks (or in chunks that cut blocks) must give the
greedy tokens and the logprobs (every top-k value, compared with ``==``) of the same prompt
computed whole in an engine without a prefix cache: on the CPU every query token's attention is
one row of the C kernel, whose chunks depend only on the row's own context, and the GGUF /
bfloat16 matmuls give a row the same bits whatever rows share its step.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_run import assert_no_leaks
from tiny_models import make_tiny_model

from treadle import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, logprobs=5, ignore_eos=True)
BLOCK = 16


def cases(base: list[int]) -> list[list[int]]:
    """Prompts that hit 1..6 blocks of those before them, none a multiple of the block size, in
    the order they are sent: the full prompt first, then its prefixes and forks."""
    return [base[:100], base[:17], base[:33] + [7, 8], base[:40], base[:65] + [9], base[:100],
            base[:47] + base[60:70]]


def outputs(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[list[tuple[int, float]]], int]]:
    """Each prompt alone, in order: (tokens, top-k logprobs per token, cached prompt tokens)."""
    got = []
    for p in prompts:
        o = llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0]
        lps = [[(t, lp.logprob) for t, lp in d.items()] for d in o.outputs[0].logprobs]
        got.append((list(o.outputs[0].token_ids), lps, o.num_cached_tokens))
    return got


def assert_hits_exact(model: str, base: list[int] | str, **kw: object) -> None:
    hit = LLM(model, block_size=BLOCK, **kw)
    if isinstance(base, str):
        base = hit.get_tokenizer()(base)["input_ids"]
    assert len(base) >= 100
    prompts = cases(base)
    cold = LLM(model, block_size=BLOCK, enable_prefix_caching=False, max_num_batched_tokens=24, **kw)
    with_hits, whole = outputs(hit, prompts), outputs(cold, prompts)
    cached = [c for _, _, c in with_hits]
    assert cached[0] == 0 and all(c >= BLOCK for c in cached[1:]), cached  # every later prompt hit
    assert {c // BLOCK for c in cached[1:]} >= {1, 2, 4, 6}
    for p, (tokens, lps, _), (tokens_cold, lps_cold, _) in zip(prompts, with_hits, whole):
        assert tokens == tokens_cold, f"prompt of {len(p)} tokens"
        assert lps == lps_cold, f"prompt of {len(p)} tokens"  # float ==: the same bits
    assert_no_leaks(hit)
    assert_no_leaks(cold)


@pytest.mark.slow
def test_smollm2_gguf_hits_and_chunks_give_the_same_bits() -> None:
    text = ("List fifty animals, one per line. Then list forty plants and thirty cities of the world, "
            "each with a short note about why it is famous, in a numbered list. ") * 3
    assert_hits_exact("smollm2-135m-instruct", text, num_kv_blocks=64)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_tiny_model_hits_and_chunks_give_the_same_bits(tmp_path: Path, dtype: str) -> None:
    path = make_tiny_model(tmp_path / "llama", "llama", seed=7)
    base = torch.randint(2, 258, (100,), generator=torch.Generator().manual_seed(3)).tolist()
    assert_hits_exact(str(path), base, num_kv_blocks=64, dtype=dtype)
