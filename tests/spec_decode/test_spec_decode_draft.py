"""The draft_model method: a draft with its KV in the target's block pool. Outputs equal plain
decoding for any draft (itself, random weights, the target's first layers), whatever the
chunking, preemption or prefix hits; a draft drafting for itself is accepted every time, which
shows its KV stays in sync with the target's (catch-up, rollback, prefix-cached blocks)."""
from __future__ import annotations

from pathlib import Path

import pytest
from engine_run import assert_no_leaks, run
from test_spec_decode_engine import grounded_prompts
from tiny_models import make_tiny_model

from treadle import LLM, SamplingParams
from treadle.config import TreadleError
from treadle.loaders.resolve import resolve_model

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def draft(model: str, k: int = 3) -> dict[str, object]:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k, "fallback": False}


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Other random weights, the tiny model's vocabulary: the worst case (few acceptances)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-draft"), seed=1, num_hidden_layers=1)


VARIANTS = {
    "plain-budget": {},
    "small-budget": {"max_num_batched_tokens": 8},  # prompt chunks beside verifies; catch-up over chunks
    "preemption": {"num_kv_blocks": 12, "max_num_batched_tokens": 32},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_stories_drafting_for_itself_is_exact_and_always_accepted(variant: str) -> None:
    stories = resolve_model("stories260k")
    kw = VARIANTS[variant]
    prompts = grounded_prompts(6, 500)
    plain, _ = run(stories, prompts, GREEDY, **kw)
    spec, llm = run(stories, prompts, GREEDY, speculative_config=draft(str(stories)), **kw)
    assert spec == plain
    stats = llm.get_stats()["spec_decode"]
    # the same model on the same (synced) KV proposes the target's own greedy tokens: a row's
    # logits do not depend on the batch shape it runs in, so every draft is accepted
    assert stats["drafts"] > 0 and stats["acceptance_rate"] == 1.0
    if variant == "preemption":
        assert llm.get_stats()["preemptions"] > 0
    assert_no_leaks(llm)


@pytest.mark.parametrize("variant", VARIANTS)
def test_random_weight_draft_is_exact(tiny_llama: Path, random_draft: Path, variant: str) -> None:
    kw = VARIANTS[variant]
    prompts = grounded_prompts(6, 200)
    plain, _ = run(tiny_llama, prompts, GREEDY, **kw)
    spec, llm = run(tiny_llama, prompts, GREEDY, speculative_config=draft(str(random_draft), 4), **kw)
    assert spec == plain
    assert llm.get_stats()["spec_decode"]["drafts"] > 0
    assert_no_leaks(llm)


@pytest.mark.parametrize("variant", VARIANTS)
def test_layer_skip_draft_is_exact(tiny_llama: Path, variant: str) -> None:
    """self:1 runs the target's first layer on the target's own KV (written in scratch slots)."""
    kw = VARIANTS[variant]
    prompts = grounded_prompts(6, 200)
    plain, _ = run(tiny_llama, prompts, GREEDY, **kw)
    spec, llm = run(tiny_llama, prompts, GREEDY, speculative_config=draft("self:1"), **kw)
    assert spec == plain
    assert llm.get_stats()["spec_decode"]["drafts"] > 0
    assert_no_leaks(llm)


@pytest.mark.parametrize("method", ["self", "random", "self:1"])
def test_seeded_sampling_reproduces_and_equals_plain(tiny_llama: Path, random_draft: Path, method: str) -> None:
    """Greedy drafts are a point mass: the target's own draws decide (fallback off)."""
    name = {"self": str(tiny_llama), "random": str(random_draft)}.get(method, method)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=77, max_tokens=24, ignore_eos=True)
    prompts = grounded_prompts(4, 200)
    plain, _ = run(tiny_llama, prompts, params)
    spec1, llm = run(tiny_llama, prompts, params, speculative_config=draft(name))
    spec2, _ = run(tiny_llama, prompts, params, speculative_config=draft(name), max_num_batched_tokens=8)
    assert spec1 == spec2 == plain
    assert llm.get_stats()["spec_decode"]["drafts"] > 0
    assert_no_leaks(llm)


def test_prefix_hit_after_speculation_equals_a_cold_run_and_carries_the_draft_kv() -> None:
    """A cached block holds the draft's KV too: after a hit the self-draft still agrees."""
    stories = resolve_model("stories260k")
    base = grounded_prompts(1, 500, seed=9)[0]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    llm = LLM(str(stories), num_kv_blocks=64, block_size=4, speculative_config=draft(str(stories)))
    first = llm.generate({"prompt_token_ids": base}, params, use_tqdm=False)[0].outputs[0].token_ids
    before = dict(llm.get_stats()["spec_decode"])
    follow = base + first[:30]  # its blocks were computed while speculating
    hit = llm.generate({"prompt_token_ids": follow}, params, use_tqdm=False)[0]
    assert hit.metrics.num_cached_tokens >= len(base)
    after = llm.get_stats()["spec_decode"]
    drafted = after["draft_tokens"] - before["draft_tokens"]
    assert drafted > 0 and after["accepted_tokens"] - before["accepted_tokens"] > 0.9 * drafted
    cold = LLM(str(stories), num_kv_blocks=64, block_size=4, enable_prefix_caching=False)
    assert hit.outputs[0].token_ids == cold.generate({"prompt_token_ids": follow}, params,
                                                      use_tqdm=False)[0].outputs[0].token_ids
    assert_no_leaks(llm)


def test_bad_drafts_are_one_line_errors(tiny_llama: Path) -> None:
    cases = {
        "stories260k": "vocabulary",  # 512 tokens against the tiny model's byte vocabulary
        "self:2": "fewer layers",
        "self:x": "layer count",
    }
    for model, words in cases.items():
        with pytest.raises(TreadleError, match=words) as info:
            LLM(str(tiny_llama), num_kv_blocks=16, speculative_config=draft(model))
        assert "\n" not in str(info.value)
    with pytest.raises(TreadleError, match="needs"):
        LLM(str(tiny_llama), num_kv_blocks=16, speculative_config={"method": "draft_model"})


def test_random_draft_with_fallback_is_exact_and_stops_drafting(tiny_llama: Path, random_draft: Path) -> None:
    """Fallback on: poor acceptance switches requests off, and the runner then runs no draft
    steps for them (``ScheduledRequest.propose``); outputs stay exact."""
    prompts = grounded_prompts(6, 200)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain, _ = run(tiny_llama, prompts, params)
    spec, llm = run(tiny_llama, prompts, params, speculative_config={**draft(str(random_draft), 4), "fallback": True})
    assert spec == plain
    stats = llm.get_stats()["spec_decode"]
    assert stats["request_fallbacks"] + stats["batch_fallbacks"] > 0
    assert stats["drafts"] < 6 * 48 / 2  # far fewer verifies than decode steps
    assert_no_leaks(llm)
