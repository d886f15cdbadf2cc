"""Gemma 3 270M (Q4_K_M GGUF) with hybrid KV: an 800-token prompt whose passage is repeated
after more than a window (512) of other text gives the same greedy tokens as the engine with
one table for all layers, while its 15 sliding layers hold about a window of KV each; a second
prompt sharing 720 tokens takes them from the prefix cache (the sliding groups' window
blocks, given back during the first request, are still indexed: each sliding group ends the
first request holding the blocks from token 288 on, and the shared prefix needs them from 208
on) and still agrees.

Two engines, each loading the file and prefilling 800 tokens in two chunks (512, 288)."""
from __future__ import annotations

import pytest
from engine_run import generate_stepwise

from treadle import LLM, SamplingParams

pytestmark = pytest.mark.slow  # both cores: a 270M model, prefilled 800 tokens at a time

BLOCK, WINDOW, NEW_TOKENS = 16, 512, 8
LONG, SHARED = 800, 720  # tokens: the long prompt, and the prefix a second prompt shares with it


def _prompts(llm: LLM) -> tuple[list[int], list[int]]:
    tok = llm.engine.tokenizer
    assert tok is not None
    story = tok.encode(" The old lighthouse keeper counted the ships that passed each night, and wrote"
                       " their names in a book that nobody else ever read.", add_special_tokens=False)
    filler = tok.encode(" ".join(f"Item {i}: a crate of {i * 7 % 13} apples." for i in range(50)),
                        add_special_tokens=False)
    long = tok.encode("Repeat the story.") + story * 3 + filler  # the passage, then 601 (> 512) other tokens: 681
    while len(long) < LONG:
        long += story
    long = long[:LONG]
    return long, long[:SHARED] + tok.encode(" Now tell it backwards, please.", add_special_tokens=False)


def test_hybrid_kv_matches_one_table_on_a_long_prompt() -> None:
    results = {}
    for hybrid in (True, False):
        # the prompts are token ids from the first engine's tokenizer: the second builds none (~3 s)
        llm = LLM("gemma-3-270m", max_model_len=2048, max_num_batched_tokens=512,
                  disable_hybrid_kv_cache_manager=not hybrid, skip_tokenizer_init=not hybrid)
        if hybrid:
            long, shared = _prompts(llm)
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        tokens, trace = generate_stepwise(llm, long, params)
        out = llm.generate([{"prompt_token_ids": shared}], params, use_tqdm=False)[0]
        results[hybrid] = (tokens, list(out.outputs[0].token_ids), out.metrics.num_cached_tokens, trace[-1])
        llm.shutdown()
    assert results[True][:2] == results[False][:2]
    cached = SHARED // BLOCK * BLOCK
    assert results[True][2] >= cached and results[False][2] >= cached
    computed, held, _ = results[True][3]
    full, *sliding = held
    assert full == -(-computed // BLOCK) and len(sliding) == 5  # 1 full group, 5 sliding groups of 3 layers
    assert all(n == full - (computed - WINDOW + 1) // BLOCK <= WINDOW // BLOCK + 1 for n in sliding)
    assert results[False][3][1] == [full]  # one table of 18 layers: every block
