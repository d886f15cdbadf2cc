"""The server through the official `openai` client: results equal the offline
LLM's token for token (greedy and seeded), streamed or not."""
from __future__ import annotations

import httpx
import openai
import pytest
from server_harness import ENGINE_KW, MODEL_NAME, serve, stories_with_chat_template

from treadle import LLM, SamplingParams
from treadle.config import TreadleError

pytestmark = pytest.mark.server  # starts processes (servers, workers)

PROMPTS = ["Once upon a time", "The little dog", "A"]
GREEDY_EXTRA = {"ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return stories_with_chat_template(tmp_path_factory.mktemp("stories"))


@pytest.fixture(scope="module")
def server(model_dir):
    with serve(model_dir) as (srv, _):
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(model_dir) -> LLM:
    return LLM(str(model_dir), **ENGINE_KW)


def reference(offline: LLM, prompts, **params):
    outs = offline.generate(prompts, SamplingParams(**params), use_tqdm=False)
    return [c for o in outs for c in o.outputs]


def token_texts(tok, ids: list[int]) -> list[str]:
    """Per-token texts, as the logprobs ``tokens`` field spells the sampled tokens (with the
    leading space a SentencePiece token carries, so they join into the text)."""
    return [tok.token_text(t) for t in ids]


def test_greedy_completions_match_offline(client, offline):
    ref = reference(offline, PROMPTS, temperature=0.0, max_tokens=12, ignore_eos=True)
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=12, temperature=0, logprobs=0,
                                     extra_body=GREEDY_EXTRA)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == [r.text for r in ref]
    tok = offline.get_tokenizer()
    assert [c.logprobs.tokens for c in resp.choices] == [token_texts(tok, r.token_ids) for r in ref]
    for c in resp.choices:  # the tokens join into the text, and each offset is where its token starts in it
        assert "".join(c.logprobs.tokens) == c.text
        assert c.logprobs.text_offset == [len("".join(c.logprobs.tokens[:i])) for i in range(len(c.logprobs.tokens))]
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.usage.completion_tokens == 36
    assert resp.usage.prompt_tokens == sum(len(offline.get_tokenizer().encode(p)) for p in PROMPTS)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 36


def test_token_id_prompts_and_logprobs_match_offline(client, offline):
    ids = [[5, 70, 80, 90], [100, 33]]
    ref = offline.generate([{"prompt_token_ids": p} for p in ids],
                           SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3), use_tqdm=False)
    resp = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0, logprobs=3,
                                     extra_body=GREEDY_EXTRA)
    tok = offline.get_tokenizer()
    for choice, out in zip(resp.choices, ref):
        c = out.outputs[0]
        lp = choice.logprobs
        assert lp.tokens == token_texts(tok, c.token_ids)
        assert lp.token_logprobs == pytest.approx([e[t].logprob for e, t in zip(c.logprobs, c.token_ids)], abs=1e-4)
        assert all(1 <= len(top) <= 4 for top in lp.top_logprobs)  # keys are token texts: byte tokens collide
        assert all(max(top.values()) >= lp_ for top, lp_ in zip(lp.top_logprobs, lp.token_logprobs))
        assert lp.text_offset[0] == 0


def test_seeded_n2_matches_offline(client, offline):
    ref = reference(offline, ["Once"], temperature=1.0, seed=77, n=2, max_tokens=10, ignore_eos=True)
    resp = client.completions.create(model=MODEL_NAME, prompt="Once", n=2, seed=77, temperature=1.0, max_tokens=10,
                                     logprobs=0, extra_body=GREEDY_EXTRA)
    choices = sorted(resp.choices, key=lambda c: c.index)
    assert [c.text for c in choices] == [r.text for r in ref]
    tok = offline.get_tokenizer()
    assert [c.logprobs.tokens for c in choices] == [token_texts(tok, r.token_ids) for r in ref]
    assert ref[0].token_ids != ref[1].token_ids  # the two choices really differ
    assert resp.usage.completion_tokens == 20


def test_streaming_equals_non_streaming(client):
    kw = dict(model=MODEL_NAME, prompt=PROMPTS[:2], n=2, seed=5, temperature=0.8, top_p=0.9, max_tokens=9,
              extra_body={"ignore_eos": True, "top_k": 50})
    whole = client.completions.create(**kw)
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert texts == {c.index: c.text for c in whole.choices}
    assert finish == {i: "length" for i in range(4)}
    assert usage is not None and usage.completion_tokens == 36 == whole.usage.completion_tokens


def test_stop_string_truncates_like_offline(client, offline):
    full = reference(offline, ["The little dog"], temperature=0.0, max_tokens=20, ignore_eos=True)[0].text
    start = next(i for i in range(5, len(full) - 3) if full[i:i + 3] not in full[:i + 2])
    stop = full[start:start + 3]  # first occurs past the first few tokens
    ref = reference(offline, ["The little dog"], temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop])[0]
    resp = client.completions.create(model=MODEL_NAME, prompt="The little dog", max_tokens=20, temperature=0,
                                     stop=[stop], extra_body=GREEDY_EXTRA)
    assert resp.choices[0].text == ref.text == full[: full.index(stop)]
    assert resp.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=MODEL_NAME, prompt="The little dog", max_tokens=20, temperature=0, stop=stop, stream=True,
        extra_body=GREEDY_EXTRA) if ch.choices)
    assert streamed == ref.text


def test_echo_prepends_prompt(client):
    resp = client.completions.create(model=MODEL_NAME, prompt="Once upon", max_tokens=4, temperature=0, echo=True,
                                     logprobs=1, extra_body=GREEDY_EXTRA)
    plain = client.completions.create(model=MODEL_NAME, prompt="Once upon", max_tokens=4, temperature=0,
                                      extra_body=GREEDY_EXTRA)
    choice = resp.choices[0]
    assert choice.text == "Once upon" + plain.choices[0].text
    n_prompt = resp.usage.prompt_tokens
    assert len(choice.logprobs.tokens) == n_prompt + 4
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.token_logprobs[1] is not None


def chat_reference(offline: LLM, messages, **params):
    return offline.chat(messages, SamplingParams(**params), use_tqdm=False)[0].outputs


def test_chat_matches_offline(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
    ref = chat_reference(offline, messages, temperature=0.0, max_tokens=10, ignore_eos=True)[0]
    resp = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=10,
                                          temperature=0, extra_body=GREEDY_EXTRA)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.text
    assert resp.usage.completion_tokens == 10 and resp.choices[0].finish_reason == "length"
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Tell me a story."}]}]
    as_parts = client.chat.completions.create(model=MODEL_NAME, messages=parts, max_tokens=10, temperature=0,
                                              extra_body=GREEDY_EXTRA)
    assert as_parts.choices[0].message.content == ref.text


def test_chat_streaming_seeded_n2_and_logprobs(client, offline):
    messages = [{"role": "user", "content": "Hello"}]
    ref = chat_reference(offline, messages, temperature=1.0, seed=3, n=2, max_tokens=8, ignore_eos=True, logprobs=2)
    texts = {0: "", 1: ""}
    roles = set()
    tokens = {0: [], 1: []}
    usage = None
    for chunk in client.chat.completions.create(
            model=MODEL_NAME, messages=messages, n=2, seed=3, temperature=1.0, max_tokens=8, logprobs=True,
            top_logprobs=2, stream=True, stream_options={"include_usage": True}, extra_body=GREEDY_EXTRA):
        usage = chunk.usage or usage
        for c in chunk.choices:
            roles.add(c.delta.role)
            texts[c.index] += c.delta.content or ""
            if c.logprobs and c.logprobs.content:
                tokens[c.index] += [(e.token, round(e.logprob, 4), len(e.top_logprobs)) for e in c.logprobs.content]
    assert "assistant" in roles
    assert [texts[0], texts[1]] == [r.text for r in ref]
    for i, r in enumerate(ref):
        assert [t[1] for t in tokens[i]] == [round(e[t].logprob, 4) for e, t in zip(r.logprobs, r.token_ids)]
        assert all(t[2] == 2 for t in tokens[i])
    assert usage.completion_tokens == 16


def test_models_version_tokenize(client, server, offline):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(f"{server.url}/version").json()["version"]
    tok = offline.get_tokenizer()
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello there"}).json()
    assert r["tokens"] == tok.encode("Hello there") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == ENGINE_KW["max_model_len"]
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": tok.encode("Hello there", False)}).json()
    assert back["prompt"] == "Hello there"
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    templated = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat["tokens"] == tok.encode(templated, add_special_tokens=False)


def test_offline_rejects_what_server_rejects(offline):
    # the 400 for an over-long prompt comes from the same engine check the offline API uses
    with pytest.raises(TreadleError):
        offline.generate(["x" * 600], SamplingParams(max_tokens=1), use_tqdm=False)


@pytest.mark.parametrize("extra", [
    {"stop_token_ids": [383]},  # " there": ends at once
    {"min_tokens": 30, "stop": ["Lily"]},  # the stop string waits for 30 tokens
    {"stop": ["was"], "include_stop_str_in_output": True},
    {"skip_special_tokens": False, "max_tokens": 60},
])
def test_vllm_sampling_extras_reach_the_engine(client, offline, extra):
    """vLLM's extra sampling fields (extra_body) act as they do offline, streamed or not."""
    kw = {"max_tokens": 40, "temperature": 0.0, **extra}
    ref = reference(offline, ["Once upon a time"], **kw)[0]
    body = {k: v for k, v in kw.items() if k not in ("max_tokens", "temperature", "stop")}
    resp = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=kw["max_tokens"],
                                     temperature=0, stop=kw.get("stop"), extra_body=body)
    assert resp.choices[0].text == ref.text and resp.usage.completion_tokens == len(ref.token_ids)
    assert resp.choices[0].finish_reason == ref.finish_reason
    stream = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=kw["max_tokens"],
                                       temperature=0, stop=kw.get("stop"), extra_body=body, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == ref.text


def test_echo_offsets_continue_after_the_prompt_when_streamed(client):
    kw = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=0, echo=True,
              extra_body=GREEDY_EXTRA)
    chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
    assert chunks[0].choices[0].text == "Once upon a time"  # the echo comes first
    generated = [o for c in chunks[1:] for o in c.choices[0].logprobs.text_offset]
    assert generated[0] == len("Once upon a time") and generated == sorted(generated)
    assert len(generated) == 6
