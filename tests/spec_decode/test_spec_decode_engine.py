"""Speculative decoding in the engine: outputs identical to plain decoding (greedy for every
configuration, seeded sampling with fallback off), whatever the chunking, preemption or
penalties; rollback leaves no blocks behind; a prefix hit after speculation equals a cold run."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_run import assert_no_leaks, run

from treadle import LLM, SamplingParams
from treadle.loaders.resolve import resolve_model

pytestmark = pytest.mark.usefixtures("one_thread")

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "fallback": False}


def grounded_prompts(n: int, vocab: int, seed: int = 3) -> list[list[int]]:
    """Random passages repeated once and cut mid-way: the continuation is in the prompt."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        passage = torch.randint(3, vocab, (int(torch.randint(8, 40, (1,), generator=g)),), generator=g).tolist()
        out.append(passage + passage[: 3 + i])
    return out




@pytest.fixture(scope="module", params=["tiny-random", "stories260k"])
def model(request: pytest.FixtureRequest, tiny_llama: Path) -> Path:
    return tiny_llama if request.param == "tiny-random" else resolve_model("stories260k")


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
VARIANTS = {
    "k4": {},
    "k1": {"speculative_config": {**NGRAM, "num_speculative_tokens": 1}},
    "k12": {"speculative_config": {**NGRAM, "num_speculative_tokens": 12}},  # 13-row verifies: still decode rows
    "small-budget": {"max_num_batched_tokens": 8},  # drafts cut by the budget, chunks beside verifies
    "preemption": {"num_kv_blocks": 12, "max_num_batched_tokens": 32},
    "reference-backend": {"attention_backend": "reference"},
    "fallback-on": {"speculative_config": {**NGRAM, "fallback": True}},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_output_identical_to_plain(model: Path, variant: str) -> None:
    kw = VARIANTS[variant]
    plain_kw = {k: v for k, v in kw.items() if k != "speculative_config"}
    prompts = grounded_prompts(6, 200 if model.name != "stories260k" else 500)
    plain, _ = run(model, prompts, GREEDY, **plain_kw)
    spec, llm = run(model, prompts, GREEDY, **{"speculative_config": NGRAM, **kw})
    assert spec == plain
    stats = llm.get_stats()["spec_decode"]
    assert stats["emitted_tokens"] == stats["accepted_tokens"] + stats["drafts"]
    if variant == "fallback-on":  # may stop speculating on these tiny models (its decisions: unit tests)
        assert stats["drafts"] > 0
    else:
        assert stats["accepted_tokens"] > 0
    if variant == "preemption":
        assert llm.get_stats()["preemptions"] > 0
    assert_no_leaks(llm)


STORY = ["Once upon a time, there was a little girl named Lily. She liked to play. Once upon a time, there was",
         "Tom had a big red ball. Tom had a big red ball. Tom had", "The sun was hot. The sun"]


def test_penalties_min_tokens_and_logprobs_identical() -> None:
    """Penalties count accepted drafts as output: the verifier's row j sees d1..dj."""
    params = SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.05, frequency_penalty=0.1,
                            presence_penalty=0.1, min_tokens=30, logprobs=2)
    llm_plain = LLM("stories260k", num_kv_blocks=128)
    llm_spec = LLM("stories260k", num_kv_blocks=128, speculative_config=NGRAM)
    prompts = [llm_plain.get_tokenizer().encode(t) for t in STORY]
    for p in prompts:
        a = llm_plain.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0]
        b = llm_spec.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0]
        assert a.token_ids == b.token_ids
        assert [max(d, key=lambda t: d[t].logprob) for d in a.logprobs] == \
               [max(d, key=lambda t: d[t].logprob) for d in b.logprobs]
        for da, db in zip(a.logprobs, b.logprobs):
            for tid in da:
                assert abs(da[tid].logprob - db[tid].logprob) < 1e-4
    assert llm_spec.get_stats()["spec_decode"]["accepted_tokens"] > 0


def test_seeded_sampling_reproduces_and_equals_plain(model: Path) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=77, max_tokens=24, ignore_eos=True)
    prompts = grounded_prompts(4, 200 if model.name != "stories260k" else 500)
    plain, _ = run(model, prompts, params)
    spec1, llm = run(model, prompts, params, speculative_config=NGRAM)
    spec2, _ = run(model, prompts, params, speculative_config=NGRAM, max_num_batched_tokens=8)
    assert spec1 == spec2 == plain  # n-gram drafts are a point mass: the plain draws decide
    assert llm.get_stats()["spec_decode"]["drafts"] > 0


def test_prefix_hit_after_speculation_equals_a_cold_run(tiny_llama: Path) -> None:
    base = grounded_prompts(1, 200, seed=9)[0]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    llm = LLM(str(tiny_llama), num_kv_blocks=64, block_size=4, speculative_config=NGRAM)
    first = llm.generate({"prompt_token_ids": base}, params, use_tqdm=False)[0].outputs[0].token_ids
    follow = base + first[:30]  # its blocks were computed while speculating
    hit = llm.generate({"prompt_token_ids": follow}, params, use_tqdm=False)[0]
    assert hit.metrics.num_cached_tokens >= len(base)
    cold = LLM(str(tiny_llama), num_kv_blocks=64, block_size=4, enable_prefix_caching=False)
    assert hit.outputs[0].token_ids == cold.generate({"prompt_token_ids": follow}, params,
                                                      use_tqdm=False)[0].outputs[0].token_ids
    assert_no_leaks(llm)


def test_stop_strings_and_eos_identical_on_stories() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=80, stop=["dog"])
    plain = LLM("stories260k").generate(STORY, params, use_tqdm=False)
    llm = LLM("stories260k", speculative_config=NGRAM)
    spec = llm.generate(STORY, params, use_tqdm=False)
    assert [(o.outputs[0].text, o.outputs[0].finish_reason) for o in spec] == \
           [(o.outputs[0].text, o.outputs[0].finish_reason) for o in plain]
    assert llm.get_stats()["spec_decode"]["accepted_tokens"] > 0
    assert_no_leaks(llm)


@pytest.mark.parametrize("speculative", [NGRAM, {"method": "eagle", "num_speculative_tokens": 3, "fallback": False}],
                         ids=["ngram", "eagle"])
def test_speculative_sampling_distribution_equals_plain_on_stories(speculative: dict[str, object]) -> None:
    """600 unseeded samples of three tokens (top-k 3: at most 27 outcomes) with and without
    drafts (n-gram; the EAGLE head shipped with stories260k). Two samples of n from one distribution: each outcome's count difference has
    standard deviation sqrt(2 n p_i), so E[TV] <= sum_i sqrt(2 p_i / n) / 2 (p from the pooled
    counts); the test allows 3x that."""
    import collections
    import math

    n = 600
    params = SamplingParams(temperature=1.0, top_k=3, n=n, max_tokens=3, ignore_eos=True)
    counts = []
    for kw in ({}, {"speculative_config": speculative}):
        llm = LLM("stories260k", max_num_seqs=1024, num_kv_blocks=1024, max_num_batched_tokens=4096, **kw)
        out = llm.generate(STORY[1], params, use_tqdm=False)[0]
        counts.append(collections.Counter(tuple(o.token_ids) for o in out.outputs))
    assert llm.get_stats()["spec_decode"]["accepted_tokens"] > 0
    keys = set(counts[0]) | set(counts[1])
    tv = 0.5 * sum(abs(counts[0][k] - counts[1][k]) for k in keys) / n
    bound = 3 * sum(math.sqrt(2 * (counts[0][k] + counts[1][k]) / (2 * n) / n) for k in keys) / 2
    assert tv < bound
