"""A bad offline request never poisons the LLM: it is refused whole before anything is
queued, a step that raises fails only its own requests, and the next generate works."""
from __future__ import annotations

import pytest

from treadle import LLM, SamplingParams
from treadle.config import StepFailedError, TreadleError
from treadle.sampling_params import SamplingParamsError

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("stories260k", num_kv_blocks=64, block_size=16, max_num_batched_tokens=64, max_model_len=256)


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[int]:
    return list(llm.generate(["Once upon a time"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def assert_idle_and_usable(llm: LLM, reference: list[int]) -> None:
    kv = llm.engine.kv_manager
    assert not llm.engine.has_unfinished_requests() and not llm.engine.scheduler.requests
    assert kv.num_free_blocks == kv.pool.num_blocks
    out = llm.generate(["Once upon a time"], GREEDY, use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == reference


@pytest.mark.parametrize("prompt, params, match", [
    ("Once", SamplingParams(stop_token_ids=[10**9], min_tokens=2), "stop_token_ids"),
    ({"prompt_token_ids": [1, 2.5]}, None, "integers"),
    ({"prompt_token_ids": [1, -3]}, None, r"\[0, "),
    ({"prompt_token_ids": "12"}, None, "list of integers"),
    ({"text": "Once"}, None, "needs 'prompt'"),
    ([1, True], None, "integers"),
])
def test_bad_request_is_refused_and_llm_stays_usable(llm, reference, prompt, params, match):
    for _ in range(2):  # and again: the first refusal left nothing behind
        with pytest.raises(TreadleError, match=match):
            llm.generate([prompt], params, use_tqdm=False)
    assert_idle_and_usable(llm, reference)


@pytest.mark.parametrize("kw, param", [
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(presence_penalty=float("-inf")), "presence_penalty"),
    (dict(n=2.0), "n"),
    (dict(max_tokens="8"), "max_tokens"),
    (dict(stop_token_ids=[1.5]), "stop_token_ids"),
    (dict(stop=["ok", 3]), "stop"),
])
def test_sampling_params_refuse_non_finite_and_wrong_types(kw, param):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kw)
    assert info.value.param == param


def test_multi_prompt_generate_is_all_or_nothing(llm, reference):
    with pytest.raises(TreadleError, match="prompt token ids"):
        llm.generate(["Once", "Once upon", [1, 10**9]], GREEDY, use_tqdm=False)
    assert_idle_and_usable(llm, reference)  # the first two were not left queued


def test_exception_inside_a_step_fails_only_that_step(llm, reference):
    """A request whose params are corrupted after admission (stop id mutated out of the
    vocabulary) makes the sampler raise mid-step: that call fails with a clear error,
    nothing leaks, and the engine keeps serving."""
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4, ignore_eos=True)
    rid = llm.engine.add_request(None, "Once", params)
    params.stop_token_ids.append(10**9)
    with pytest.raises(StepFailedError) as info:
        llm.collect([rid])
    assert info.value.request_ids == [rid] and isinstance(info.value.cause, IndexError)
    assert_idle_and_usable(llm, reference)


def test_stream_keeps_outputs_of_requests_finishing_meanwhile(llm, reference):
    other = llm.engine.add_request(None, "Once upon a time", GREEDY)
    long = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    streamed = list(llm.stream("Once", long))
    assert streamed[-1].finished and len(streamed[-1].outputs[0].token_ids) == 12
    kept = llm.collect([other])  # it finished during the stream and was kept for us
    assert list(kept[0].outputs[0].token_ids) == reference


def test_two_interleaved_streams_both_complete(llm):
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    alone = [list(o.outputs[0].token_ids) for o in llm.generate(["Once"], params) + llm.generate(["Lily"], params)]
    a = llm.stream("Once", params)
    b = llm.stream("Lily", params)
    outs_a, outs_b = [next(a)], [next(b)]
    outs_a += list(a)
    outs_b += list(b)
    assert outs_a[-1].finished and outs_b[-1].finished
    # each stream's tokens are the ones its prompt gets alone
    assert [[t for o in outs for t in o.outputs[0].new_token_ids] for outs in (outs_a, outs_b)] == alone


@pytest.mark.parametrize(("prompts", "params", "fragment"), [
    (5, None, "prompts must be a prompt or a list of prompts, not int"),
    (["a"], {"max_tokens": 3}, "sampling_params must be a SamplingParams or a list of them, not dict"),
    (["a", "b"], [SamplingParams(), SamplingParams(), SamplingParams()], "one per prompt"),
])
def test_generate_argument_mistakes_are_treadle_errors(llm, prompts, params, fragment):
    with pytest.raises(TreadleError, match=fragment):
        llm.generate(prompts, params, use_tqdm=False)


def test_stop_strings_wait_for_min_tokens(llm):
    """As vLLM: a stop string ends a request only once it has more than min_tokens tokens, and
    one completed before that does not count later."""
    prompt = "Once upon a time, there was a little girl named Lily. She liked to play. Once upon a time, there was"
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=60, stop=["Lily"]), use_tqdm=False)[0]
    assert len(free.outputs[0].token_ids) < 10 and free.outputs[0].stop_reason == "Lily"
    held = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=60, min_tokens=10, stop=["Lily"]),
                        use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) > 10 and held.stop_reason == "Lily" and held.text.count("Lily") == 1


def test_a_stop_token_stays_out_of_the_text(llm):
    """As vLLM: the token that matched stop_token_ids is in token_ids, not in the text."""
    prompt = "Tom had a big red ball. Tom had a big red ball. Tom had"
    stop_id = llm.get_tokenizer().encode(" ball", add_special_tokens=False)[-1]
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids[-1] == stop_id and out.stop_reason == stop_id
    before = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=len(out.token_ids) - 1),
                          use_tqdm=False)[0].outputs[0]  # the same tokens but the stop token
    assert out.text == before.text and not before.text.endswith(" ball")
    streamed = "".join(o.outputs[0].new_text for o in llm.stream(prompt, SamplingParams(
        temperature=0.0, max_tokens=60, stop_token_ids=[stop_id])))
    assert streamed == out.text


def test_priority_list_and_num_cached_tokens(llm):
    """A priority list must match the prompts; RequestOutput.num_cached_tokens is there, as in vLLM."""
    with pytest.raises(TreadleError, match="one priority per prompt"):
        llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=[0])
    first = llm.generate(["Once upon a time there was a girl who liked to play in the sun"], GREEDY,
                         use_tqdm=False)[0]
    again = llm.generate(["Once upon a time there was a girl who liked to play in the sun"], GREEDY,
                         use_tqdm=False)[0]
    assert again.num_cached_tokens == again.metrics.num_cached_tokens > first.num_cached_tokens


def test_chat_takes_add_generation_prompt_and_tools(tmp_path):
    from server_harness import stories_with_chat_template

    chat_llm = LLM(str(stories_with_chat_template(tmp_path)), num_kv_blocks=32)
    msgs = [{"role": "user", "content": "Tell me a story"}]
    tok = chat_llm.get_tokenizer()
    for add in (True, False):
        out = chat_llm.chat(msgs, GREEDY, use_tqdm=False, add_generation_prompt=add)[0]
        assert out.prompt == tok.apply_chat_template(msgs, add_generation_prompt=add)
    assert chat_llm.chat(msgs, GREEDY, use_tqdm=False)[0].prompt != chat_llm.chat(
        msgs, GREEDY, use_tqdm=False, add_generation_prompt=False)[0].prompt


def test_tokenizer_answers_what_transformers_code_asks(tmp_path):
    """get_tokenizer() is Treadle's own tokenizer, with the calls code written against
    transformers' tokenizers makes most: __call__, len, eos_token_id, convert_ids_to_tokens,
    apply_chat_template(tokenize=...)."""
    from server_harness import stories_with_chat_template

    tok = LLM(str(stories_with_chat_template(tmp_path)), num_kv_blocks=8).get_tokenizer()
    ids = tok.encode("Once upon a time")
    assert tok("Once upon a time") == {"input_ids": ids, "attention_mask": [1] * len(ids)}
    assert len(tok) == tok.vocab_size and tok.eos_token_id == tok.eos_token_ids[0]
    pieces = tok.convert_ids_to_tokens(tok.encode("Once upon a time", add_special_tokens=False))
    assert "".join(p or "" for p in pieces).replace("\u2581", " ").strip() == "Once upon a time"
    msgs = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert tok.apply_chat_template(msgs, tokenize=True) == tok.encode(text, add_special_tokens=False)
