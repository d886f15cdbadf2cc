"""Gemma 3 against transformers on a tiny random-weight model (float32): logits through the
paged cache with both attention backends, and the engine's greedy tokens on every path
(a batch, chunked prefill, preemption, prefix-cache hits) over prompts longer than the
sliding window, so the windowed layers really drop keys.

The model has sliding and full layers (window 16, RoPE bases 10000 / 1e6), head_dim 32
while hidden / heads is 16, query_pre_attn_scalar unlike head_dim, and random norm weights
(so the (1 + weight) norms are exercised, not all-ones multipliers)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_run import assert_no_leaks, run
from paged_session import PagedSession
from tiny_models import write_byte_tokenizer

from treadle import SamplingParams
from treadle.layers.attention import ReferenceBackend
from treadle.layers.attention.cpu import CPUBackend
from treadle.loaders import load_model

WINDOW = 16
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
PROMPT_LENS = (45, 23, 7)
NEW_TOKENS = 24

pytestmark = pytest.mark.usefixtures("one_thread")


def make_tiny_gemma3(path: Path, seed: int = 0) -> Path:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    vocab = write_byte_tokenizer(path)
    config = Gemma3TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
        sliding_window=WINDOW, layer_types=LAYER_TYPES, max_position_embeddings=256,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        bos_token_id=0, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True,
    )
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # larger weights than the default init, so tokens vary; norms not all zero
        for p in model.parameters():
            p.normal_(0, 0.15 if p.dim() == 2 else 0.3)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="module")
def hf_model(gemma_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gemma_dir, attn_implementation="eager", dtype=torch.float32).eval()


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 258, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def test_config_reads_layer_kinds(gemma_dir: Path) -> None:
    cfg = load_model(str(gemma_dir), ReferenceBackend()).config
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.tie_word_embeddings
    assert [cfg.layer_window(i) for i in range(4)] == [WINDOW, None, WINDOW, WINDOW]
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 24.0)


@pytest.mark.parametrize("backend", [ReferenceBackend, CPUBackend])
def test_logits_match_transformers_through_paged_cache(gemma_dir: Path, hf_model, backend) -> None:
    """A batch of prompts (one longer than two windows) prefilled together, then 12 tokens
    decoded one at a time: every position's logits match transformers' full forward."""
    lm = load_model(str(gemma_dir), backend())
    prompts, continuation = _prompts(1), _prompts(2)[0][:12]
    session = PagedSession(lm, len(prompts), max(PROMPT_LENS) + len(continuation))
    ours = [[row] for row in session.feed(prompts)]
    for tok in continuation:
        for acc, row in zip(ours, session.feed([[tok]] * len(prompts))):
            acc.append(row)
    for prompt, acc in zip(prompts, ours):
        with torch.no_grad():
            expected = hf_model(torch.tensor([prompt + continuation])).logits[0]
        torch.testing.assert_close(torch.cat(acc), expected, rtol=0, atol=1e-4)
        assert expected.std() > 0.1


ENGINE_PATHS = {
    "batch": {},
    "chunked": dict(max_num_batched_tokens=8),
    # hybrid KV: a block holds one layer's KV here (4 groups of 1 layer), so 40 blocks are 10 of one table
    "preempt": dict(num_kv_blocks=40, block_size=8),
    "preempt-one-table": dict(num_kv_blocks=12, block_size=8, disable_hybrid_kv_cache_manager=True),
    "ngram-spec": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                           "prompt_lookup_max": 2}),
}


@pytest.mark.parametrize("path", list(ENGINE_PATHS))
def test_engine_greedy_matches_transformers(gemma_dir: Path, hf_model, path: str) -> None:
    prompts = _prompts(3)
    got, llm = run(gemma_dir, prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
                   **ENGINE_PATHS[path])
    if path.startswith("preempt"):
        assert llm.engine.stats.num_preemptions > 0
    for prompt, tokens in zip(prompts, got):
        assert tokens == _hf_greedy(hf_model, prompt, NEW_TOKENS)
    assert_no_leaks(llm)


def test_prefix_cache_hits_give_the_same_tokens(gemma_dir: Path, hf_model) -> None:
    """A second request sharing a 40-token prefix (past the window) takes cache hits and
    still continues exactly as transformers does."""
    from treadle import LLM

    base = _prompts(4)[0][:40]
    llm = LLM(str(gemma_dir), num_kv_blocks=64, block_size=8, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": base + [5, 6, 7]}], params, use_tqdm=False)
    second = base + [9, 10, 11, 12]
    out = llm.generate([{"prompt_token_ids": second}], params, use_tqdm=False)[0]
    assert out.metrics.num_cached_tokens >= 32
    assert list(out.outputs[0].token_ids) == _hf_greedy(hf_model, second, 16)
    assert_no_leaks(llm)


@pytest.mark.server
@pytest.mark.slow  # two worker processes: ~15-40 s on 2 cores
def test_two_tensor_parallel_ranks_match_transformers(gemma_dir: Path, hf_model) -> None:
    """T = 2: each rank holds 2 of the 4 query heads and 1 of the 2 KV heads; the output norms
    come after the all-reduces."""
    from treadle import LLM

    prompts = _prompts(5)
    llm = LLM(str(gemma_dir), tensor_parallel_size=2, num_kv_blocks=64, block_size=8)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == _hf_greedy(hf_model, prompt, NEW_TOKENS)
