"""Gemma 3's hybrid KV on a tiny random-weight model (window 16, block size 8, one full and
three sliding layers: four KV groups of one layer): a prompt several windows long, holding a
copy of its opening beyond the window, gives transformers' greedy tokens through chunked
prefill while the sliding groups hold only their window's blocks; the engine with one table
for all layers gives the same tokens and holds every block."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_run import assert_no_leaks, generate_stepwise
from test_gemma3_model import WINDOW, make_tiny_gemma3

from treadle import LLM, SamplingParams

BLOCK = 8
NEW_TOKENS = 16

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3-kv"), seed=1)


def _prompt() -> list[int]:
    g = torch.Generator().manual_seed(7)
    opening, middle = torch.randint(2, 258, (30,), generator=g).tolist(), torch.randint(2, 258, (50,), generator=g).tolist()
    return opening + middle + opening  # the copy's source lies 80 tokens back, 5 windows


def test_windowed_groups_hold_a_window_and_match_transformers(gemma_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    prompt = _prompt()
    hf = AutoModelForCausalLM.from_pretrained(gemma_dir, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                               min_new_tokens=NEW_TOKENS)[0, len(prompt):].tolist()
    runs = {}
    for hybrid in (True, False):
        llm = LLM(str(gemma_dir), num_kv_blocks=128, block_size=BLOCK, max_num_batched_tokens=24,
                  disable_hybrid_kv_cache_manager=not hybrid)
        runs[hybrid] = generate_stepwise(llm, prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                                     ignore_eos=True))
        assert runs[hybrid][0] == expected, f"hybrid={hybrid}"
        assert_no_leaks(llm)
    for computed, held, in_use in runs[True][1]:  # 4 groups of 1 layer: a block is one layer's KV
        full, *sliding = held
        assert full == -(-computed // BLOCK)
        assert sliding == [full - max(0, computed - WINDOW + 1) // BLOCK] * 3
        assert max(sliding) <= -(-WINDOW // BLOCK) + 1 and in_use == full + sum(sliding)
    for computed, held, in_use in runs[False][1]:  # one table: a block is all 4 layers' KV
        assert held == [-(-computed // BLOCK)] and in_use == held[0]
    computed, (full, *sliding), _ = runs[True][1][-1]
    assert computed == len(prompt) + NEW_TOKENS - 2 and full == 16 and sliding == [3] * 3
    # layer-blocks held at the end: 1 x 16 + 3 x 3 = 25, against 4 x 16 = 64 with one table
    assert runs[False][1][-1][2] * 4 == 64 and full + sum(sliding) == 25


def test_draft_model_speculation_with_hybrid_kv(gemma_dir: Path) -> None:
    """A draft model keeps its own KV in every layer through the target's first (full) table
    while the target's sliding groups give blocks back: greedy tokens stay the one-table run's."""
    prompt = _prompt()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    draft = {"method": "draft_model", "model": str(gemma_dir), "num_speculative_tokens": 3, "fallback": False}
    got = {}
    for hybrid in (True, False):
        llm = LLM(str(gemma_dir), num_kv_blocks=128, block_size=BLOCK, max_num_batched_tokens=24,
                  disable_hybrid_kv_cache_manager=not hybrid, speculative_config=draft)
        got[hybrid] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
        assert llm.engine.spec is not None and llm.engine.spec.stats.num_accepted_tokens > 0
        assert_no_leaks(llm)
    assert got[True] == got[False]
