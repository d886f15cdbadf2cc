"""Engine invariants: greedy output equals transformers and does not depend on
batch composition, arrival order, chunk size, preemption or cache hits."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_run import assert_no_leaks, run

from treadle import LLM, SamplingParams
from treadle.config import TreadleError
from treadle.loaders.resolve import resolve_model

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_TOKENS = 16


def random_prompts(n: int, vocab: int, seed: int = 1, lo: int = 3, hi: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(2, vocab, (n_tok,), generator=g).tolist() for n_tok in lengths]




def hf_greedy(model_dir, prompts, max_tokens) -> list[list[int]]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    outs = []
    for p in prompts:
        ids = hf.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
        outs.append(ids[0, len(p):].tolist())
    return outs


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=["tiny-random", "stories260k"])
def model(request, tiny_llama) -> Path:
    return tiny_llama if request.param == "tiny-random" else resolve_model("stories260k")


@pytest.fixture(scope="module")
def prompts(model) -> list[list[int]]:
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    return random_prompts(7, vocab)


@pytest.fixture(scope="module")
def batched(model, prompts):
    greedy, llm = run(model, prompts, GREEDY)
    assert_no_leaks(llm)
    seeded, _ = run(model, prompts, SEEDED)
    return greedy, seeded


def test_batched_greedy_equals_transformers(model, prompts, batched):
    assert batched[0] == hf_greedy(model, prompts, MAX_TOKENS)


@pytest.mark.parametrize("variant", ["one_by_one", "reversed", "chunk1", "chunk7", "chunk64", "preempt", "nochunk",
                                     "reference"])
def test_output_independent_of_schedule(model, prompts, batched, variant):
    for params, expected in zip((GREEDY, SEEDED), batched):
        kw: dict = {}
        if variant == "one_by_one":
            got = [run(model, [p], params)[0][0] for p in prompts]
        elif variant == "reversed":
            got = run(model, prompts[::-1], params)[0][::-1]
        else:
            kw = {"chunk1": dict(max_num_batched_tokens=1), "chunk7": dict(max_num_batched_tokens=7),
                  "chunk64": dict(max_num_batched_tokens=64), "preempt": dict(num_kv_blocks=9, block_size=8),
                  "nochunk": dict(enable_chunked_prefill=False, max_num_batched_tokens=64),
                  "reference": dict(attention_backend="reference")}[variant]
            got, llm = run(model, prompts, params, **kw)
            if variant == "preempt":
                assert llm.engine.stats.num_preemptions > 0
            assert_no_leaks(llm)
        assert got == expected


def test_prefix_cache_hits_do_not_change_output(tiny_llama):
    shared = random_prompts(1, 258, seed=5, lo=40, hi=41)[0]
    prompts = [shared + [7, 8, 9], shared + [10], shared + [11, 12]]
    llm = LLM(str(tiny_llama), num_kv_blocks=128, block_size=16)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)[0]
    assert first.metrics.num_cached_tokens == 0
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert again[0].metrics.num_cached_tokens == 32 and again[1].metrics.num_cached_tokens == 32
    assert again[0].outputs[0].token_ids == first.outputs[0].token_ids
    fresh = run(tiny_llama, prompts[1:], GREEDY)[0]
    assert [o.outputs[0].token_ids for o in again[1:]] == fresh
    assert_no_leaks(llm)


def test_abort_frees_everything(tiny_llama):
    prompts = random_prompts(7, 258)
    llm = LLM(str(tiny_llama), num_kv_blocks=64)
    for i, p in enumerate(prompts):
        llm.engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    llm.engine.step()
    llm.engine.step()
    llm.engine.abort_request([str(i) for i in range(0, len(prompts), 2)])
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    llm.engine.abort_request([str(i) for i in range(len(prompts))])  # already gone: a no-op
    assert_no_leaks(llm)


def test_refuses_impossible_request_and_keeps_serving(tiny_llama):
    llm = LLM(str(tiny_llama), num_kv_blocks=8, block_size=16, max_model_len=256)
    with pytest.raises(TreadleError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [5] * 260}], SamplingParams(max_tokens=10), use_tqdm=False)
    # as vLLM's offline LLM: a max_tokens that would run past max_model_len stops there
    roomy = LLM(str(tiny_llama), num_kv_blocks=20, block_size=16, max_model_len=256)
    near = roomy.generate([{"prompt_token_ids": [5] * 100}], SamplingParams(max_tokens=200, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert len(near.token_ids) == 156 and near.finish_reason == "length"
    with pytest.raises(TreadleError, match="KV blocks"):
        llm.generate([{"prompt_token_ids": [5] * 120}], SamplingParams(max_tokens=20), use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == MAX_TOKENS
    assert_no_leaks(llm)


def test_model_that_does_not_fit_says_what_it_needs():
    with pytest.raises(TreadleError, match=r"needs .* for weights plus 1024\.0 GiB of KV cache .* available"):
        LLM("stories260k", kv_cache_memory="1TiB")


def test_n_completions_share_prompt_blocks(tiny_llama):
    prompt = random_prompts(1, 258, seed=9, lo=50, hi=51)[0]
    llm = LLM(str(tiny_llama), num_kv_blocks=64, block_size=16)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different samples
    assert out.metrics.num_cached_tokens == 0
    # siblings reuse the first one's 3 full prompt blocks: only 2 prompt tokens each are
    # computed; then 7 decode steps each
    assert llm.engine.stats.num_tokens_computed == 50 + 2 * (50 - 48) + 3 * 7
    assert_no_leaks(llm)


def test_logprobs_close_to_transformers(tiny_llama):
    import transformers

    prompt = random_prompts(1, 258, seed=3, lo=20, hi=21)[0]
    llm = LLM(str(tiny_llama), num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    full = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([full])).logits[0].float().log_softmax(-1)
    for i, (tok, lp) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert abs(lp[tok].logprob - float(row[tok])) < 1e-4
        assert lp[tok].rank == 1
        top = sorted(lp.items(), key=lambda kv: -kv[1].logprob)[:3]
        assert [t for t, _ in top] == row.topk(3).indices.tolist()
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for j in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[j][prompt[j]].logprob - float(ref[j - 1, prompt[j]])) < 1e-4


def test_stories260k_text_stops_on_bos_and_stop_strings():
    llm = LLM("stories260k", num_kv_blocks=128)
    greedy = SamplingParams(temperature=0.0, max_tokens=400)
    full = llm.generate(["Once upon a time"], greedy, use_tqdm=False)[0].outputs[0]
    assert full.text.startswith(", there was a little girl named Lily. She loved to play outside in the park.")
    assert full.finish_reason == "stop" and full.stop_reason is None  # ends the story on BOS/EOS (vLLM: None)
    cut = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=400, stop=["girl na"]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.text == ", there was a little " and cut.finish_reason == "stop" and cut.stop_reason == "girl na"
    streamed = "".join(o.outputs[0].new_text for o in llm.stream("Once upon a time", greedy))
    assert streamed == full.text
    assert_no_leaks(llm)


def test_prefix_caching_can_be_turned_off(tiny_llama):
    prompt = {"prompt_token_ids": random_prompts(1, 258, seed=4, lo=40, hi=41)[0]}
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    cached, uncached = (LLM(str(tiny_llama), num_kv_blocks=64, enable_prefix_caching=flag) for flag in (True, False))
    for llm, hits in ((cached, 32), (uncached, 0)):
        first = llm.generate([prompt], params, use_tqdm=False)[0]
        again = llm.generate([prompt], params, use_tqdm=False)[0]
        assert again.metrics.num_cached_tokens == hits  # two full 16-token blocks, or nothing
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        assert_no_leaks(llm)


def test_prompt_logprobs_survive_prefix_hits_chunking_and_preemption(tiny_llama):
    """Every prompt position scored once, in place: a prompt that would hit the prefix cache is
    computed anyway (its cached positions have no logits), and a preempted request that
    computes its prompt again does not score it twice."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    shared = random_prompts(1, 258, seed=7, lo=40, hi=41)[0]
    prompts = [shared + [5, 6, 7], shared + [5, 6, 7], shared + [9, 10]] + random_prompts(3, 258, seed=8, lo=30, hi=45)
    params = SamplingParams(temperature=0.0, max_tokens=24, prompt_logprobs=1, ignore_eos=True)

    def check(outs):
        for p, out in zip(prompts, outs, strict=True):
            with torch.no_grad():
                ref = hf(torch.tensor([p])).logits[0].float().log_softmax(-1)
            assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
            for j in range(1, len(p)):
                assert abs(out.prompt_logprobs[j][p[j]].logprob - float(ref[j - 1, p[j]])) < 1e-4

    llm = LLM(str(tiny_llama), num_kv_blocks=64, block_size=8, max_num_batched_tokens=16)
    check([llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts])  # one by one
    tight = LLM(str(tiny_llama), num_kv_blocks=18, block_size=8, max_num_batched_tokens=32)
    check(tight.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))  # all at once
    assert tight.get_stats()["preemptions"] > 0
    assert_no_leaks(llm)
    assert_no_leaks(tight)
