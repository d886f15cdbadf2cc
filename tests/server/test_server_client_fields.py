"""What real clients send (issue 34): scoring requests (max_tokens 0 + echo + logprobs),
prompt_logprobs, stream_options.continuous_usage_stats, /tokenizer_info, the logprob
budget, and every field of vLLM's completion and chat request models, each either
honoured (the response shows it) or refused by a 400 that names it. Real server, real
stories260k weights, offline LLM as the reference."""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from server_harness import ENGINE_KW, MODEL_NAME, serve, stories_with_chat_template

from treadle import LLM, SamplingParams
from treadle.server.state import ServerLimits

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = "Once upon a time"
MSGS = [{"role": "user", "content": PROMPT}]
BUDGET = 20_000  # the test server's --max-logprob-entries
pytestmark = [pytest.mark.server, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return stories_with_chat_template(tmp_path_factory.mktemp("stories"))


@pytest.fixture(scope="module")
def url(model_dir):
    with serve(model_dir, limits=ServerLimits(max_logprob_entries=BUDGET), enable_tokenizer_info=True) as (srv, _):
        yield srv.url


@pytest.fixture(scope="module")
def offline(model_dir) -> LLM:
    return LLM(str(model_dir), **ENGINE_KW)


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json={"model": MODEL_NAME, **body}, timeout=60)


def sse_chunks(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", url + path, json={"model": MODEL_NAME, "stream": True, **body}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def ref(offline: LLM, prompt: Any = PROMPT, **params: Any):
    return offline.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]


# -- scoring: max_tokens 0 with echo ------------------------------------------------------
def test_echo_with_max_tokens_zero_returns_the_prompt_and_its_logprobs(url, offline):
    expected = ref(offline, max_tokens=1, prompt_logprobs=2)
    r = post(url, CMPL, {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == len(expected.prompt_token_ids)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(expected.prompt_token_ids) and lp["token_logprobs"][0] is None
    want = [e[t].logprob for e, t in zip(expected.prompt_logprobs[1:], expected.prompt_token_ids[1:])]
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
    assert all(len(top) <= 3 for top in lp["top_logprobs"][1:])
    # streamed: the prompt in one chunk, then an empty "length" chunk; no generated text
    chunks = sse_chunks(url, CMPL, {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 2,
                                    "stream_options": {"include_usage": True}})
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == PROMPT
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 0


def test_max_tokens_zero_without_echo_is_still_a_400(url):
    r = post(url, CMPL, {"prompt": PROMPT, "max_tokens": 0, "logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


# -- prompt_logprobs ----------------------------------------------------------------------
def _check_prompt_logprobs(got: list[Any], expected) -> None:
    ids = expected.prompt_token_ids
    assert len(got) == len(ids) and got[0] is None
    for entry, want, tid in zip(got[1:], expected.prompt_logprobs[1:], ids[1:]):
        assert {int(k) for k in entry} == set(want)
        assert entry[str(tid)]["logprob"] == pytest.approx(want[tid].logprob, abs=1e-4)
        assert {entry[str(t)]["rank"] for t in want} == {lp.rank for lp in want.values()}
        assert all(isinstance(v["decoded_token"], str) for v in entry.values())


def test_prompt_logprobs_in_each_completion_choice(url, offline):
    expected = ref(offline, max_tokens=4, temperature=0, prompt_logprobs=3)
    r = post(url, CMPL, {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "n": 2, "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        _check_prompt_logprobs(choice["prompt_logprobs"], expected)


def test_prompt_logprobs_in_a_chat_response(url, offline):
    prompt = offline.get_tokenizer().apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True)
    expected = ref(offline, {"prompt_token_ids": prompt}, max_tokens=4, temperature=0, prompt_logprobs=1)
    r = post(url, CHAT, {"messages": MSGS, "max_tokens": 4, "temperature": 0, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    _check_prompt_logprobs(r.json()["prompt_logprobs"], expected)  # top level, as vLLM's chat response


def test_streamed_prompt_logprobs_are_refused_by_name(url):
    r = httpx.post(url + CMPL, json={"prompt": PROMPT, "stream": True, "prompt_logprobs": 1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


# -- continuous usage ---------------------------------------------------------------------
@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_continuous_usage_stats_on_every_chunk(url, path):
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 2,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    body.update({"prompt": PROMPT} if path == CMPL else {"messages": MSGS})
    chunks = sse_chunks(url, path, body)
    assert all("usage" in c for c in chunks)
    done = [c["usage"]["completion_tokens"] for c in chunks]
    assert done == sorted(done) and done[-1] == 12  # grows chunk by chunk to the total
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in chunks)
    plain = sse_chunks(url, path, {**body, "stream_options": {"include_usage": True}})
    assert ["usage" in c for c in plain] == [False] * (len(plain) - 1) + [True]


# -- /tokenizer_info ----------------------------------------------------------------------
def test_tokenizer_info_when_enabled(url, offline):
    info = httpx.get(url + "/tokenizer_info", timeout=10).json()
    tok = offline.get_tokenizer()
    assert info["eos_token"] == tok.eos_token and info["bos_token"] == tok.bos_token
    assert info["eos_token_id"] == tok.eos_token_id and info["vocab_size"] == len(tok)
    assert info["chat_template"] == tok.chat_template and info["model_max_length"] == ENGINE_KW["max_model_len"]
    assert isinstance(info["tokenizer_class"], str)


def test_tokenizer_info_is_a_404_without_the_flag(model_dir):
    with serve(model_dir, in_process=True) as (srv, _):
        r = httpx.get(srv.url + "/tokenizer_info", timeout=10)
    assert r.status_code == 404 and "error" in r.json()


# -- the logprob budget -------------------------------------------------------------------
def test_logprob_fan_out_over_the_budget_is_a_400_naming_the_limit(url):
    # 4 prompts x n=8 x 100 tokens x (20 + 1) = 67,200 entries > 20,000
    r = post(url, CMPL, {"prompt": [PROMPT] * 4, "n": 8, "max_tokens": 100, "logprobs": 20})
    assert r.status_code == 400 and "--max-logprob-entries" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "logprobs"
    r = post(url, CHAT, {"messages": MSGS, "n": 64, "max_tokens": 100, "logprobs": True, "top_logprobs": 5})
    assert r.status_code == 400 and "--max-logprob-entries" in r.json()["error"]["message"]
    # under it, and the same fan-out without logprobs, are served
    assert post(url, CMPL, {"prompt": [PROMPT] * 4, "n": 8, "max_tokens": 4, "logprobs": 20}).status_code == 200
    assert post(url, CMPL, {"prompt": [PROMPT] * 4, "n": 8, "max_tokens": 100}).status_code == 200


# -- every field of vLLM's request models: honoured or refused by name ---------------------
Check = Callable[[dict[str, Any], Any], None]  # (response body, fixtures) -> assert


def _text(body: dict[str, Any]) -> str:
    c = body["choices"][0]
    return c["text"] if "text" in c else c["message"]["content"]


# value, and how the response shows it was honoured; REFUSE: a 400 naming the field
REFUSE = "refuse"
COMMON: dict[str, tuple[Any, Any]] = {
    "model": (MODEL_NAME, lambda b, f: b["model"] == MODEL_NAME),
    "frequency_penalty": (1.5, "engine"),
    "presence_penalty": (1.5, "engine"),
    "repetition_penalty": (1.8, "engine"),
    "logit_bias": ({"5": 10.0}, REFUSE),
    "max_tokens": (5, lambda b, f: b["usage"]["completion_tokens"] == 5),
    "n": (2, lambda b, f: len(b["choices"]) == 2),
    "seed": (7, "engine"),
    "stop": (None, "stop"),  # value picked from the greedy text
    "stream": (True, "stream"),
    "stream_options": ({"include_usage": True}, "stream"),
    "temperature": (0.0, lambda b, f: _text(b) == f["greedy"]),
    "top_p": (1e-9, "greedy_at_t1"),
    "top_k": (1, "greedy_at_t1"),
    "min_p": (1.0, "greedy_at_t1"),
    "user": ("user-1", lambda b, f: _text(b) == f["greedy"]),  # an id for abuse tracking: no effect
    "use_beam_search": (True, REFUSE),
    "length_penalty": (2.0, REFUSE),
    "stop_token_ids": (None, "stop_token_ids"),
    "include_stop_str_in_output": (True, "stop"),
    "ignore_eos": (True, lambda b, f: b["usage"]["completion_tokens"] == 12),
    "min_tokens": (8, "stop_token_ids"),
    "skip_special_tokens": (False, "engine"),
    "spaces_between_special_tokens": (False, REFUSE),
    "truncate_prompt_tokens": (2, REFUSE),
    "allowed_token_ids": ([5, 6], REFUSE),
    "prompt_logprobs": (1, lambda b, f: "prompt_logprobs" in b or "prompt_logprobs" in b["choices"][0]),
    "response_format": ({"type": "json_object"}, lambda b, f: _text(b).lstrip()[:1] in "{["),
    "guided_json": ({"type": "object"}, lambda b, f: _text(b).lstrip()[:1] == "{"),
    "guided_regex": ("(cat|dog)", lambda b, f: _text(b) in ("cat", "dog")),
    "guided_choice": (["yes", "no"], lambda b, f: _text(b) in ("yes", "no")),
    "guided_grammar": ('root ::= "yes" | "no"', lambda b, f: _text(b) in ("yes", "no")),
    "guided_decoding_backend": ("xgrammar", REFUSE),
    "guided_whitespace_pattern": (r"\s*", REFUSE),
    "priority": (1, lambda b, f: _text(b) == f["greedy"]),  # an order in the queue: same tokens
    "request_id": ("my-id", REFUSE),
    "logits_processors": (["my.module.Proc"], REFUSE),
    "return_tokens_as_token_ids": (True, REFUSE),
    "cache_salt": ("salt", REFUSE),
    "kv_transfer_params": ({"do_remote_decode": True}, REFUSE),  # honoured only with --kv-transfer-config
    "vllm_xargs": ({"a": 1}, REFUSE),
    "structured_outputs": ({"choice": ["yes", "no"]}, lambda b, f: _text(b) in ("yes", "no")),
}
COMPLETION_FIELDS = {
    **COMMON,
    "prompt": ([5, 70, 80], lambda b, f: b["usage"]["prompt_tokens"] == 3),
    "prompt_embeds": ("AAAA", REFUSE),
    "best_of": (1, lambda b, f: len(b["choices"]) == 1),
    "echo": (True, lambda b, f: b["choices"][0]["text"].startswith(PROMPT)),
    "logprobs": (2, lambda b, f: len(b["choices"][0]["logprobs"]["tokens"]) == 12),
    "suffix": ("The end.", REFUSE),
    "add_special_tokens": (False, lambda b, f: b["usage"]["prompt_tokens"] == f["prompt_tokens"] - 1),
}
CHAT_FIELDS = {
    **COMMON,
    "messages": ([{"role": "user", "content": "A"}], lambda b, f: b["usage"]["prompt_tokens"] < f["prompt_tokens"]),
    "logprobs": (True, lambda b, f: len(b["choices"][0]["logprobs"]["content"]) == 12),
    "top_logprobs": (2, lambda b, f: all(len(c["top_logprobs"]) == 2 for c in b["choices"][0]["logprobs"]["content"])),
    "max_completion_tokens": (5, lambda b, f: b["usage"]["completion_tokens"] == 5),
    "tools": ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
              lambda b, f: b["choices"][0]["message"]["content"] is not None),
    "tool_choice": ("none", lambda b, f: "tool_calls" not in b["choices"][0]["message"]),
    "parallel_tool_calls": (True, lambda b, f: _text(b) == f["greedy"]),
    "reasoning_effort": ("low", REFUSE),
    "include_reasoning": (False, REFUSE),
    "best_of": (2, REFUSE),
    "bad_words": (["the"], REFUSE),
    "echo": (True, REFUSE),
    "add_generation_prompt": (False, lambda b, f: b["usage"]["prompt_tokens"] < f["prompt_tokens"]),
    "continue_final_message": (True, REFUSE),
    "add_special_tokens": (True, lambda b, f: b["usage"]["prompt_tokens"] == f["prompt_tokens"] + 1),
    "documents": ([{"title": "t", "text": "x"}], REFUSE),
    "chat_template": ("{{ messages[0]['content'] }}", REFUSE),
    "chat_template_kwargs": ({"enable_thinking": False}, REFUSE),
    "mm_processor_kwargs": ({"a": 1}, REFUSE),
    "structural_tag": ('{"type": "structural_tag"}', REFUSE),
}
STRUCTURED = {"response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
              "structured_outputs"}


def _base(path: str) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    body.update({"prompt": PROMPT} if path == CMPL else {"messages": MSGS})
    return body


@pytest.fixture(scope="module")
def facts(url, offline):
    """Per endpoint: the greedy text, its token ids and the prompt length."""
    out = {}
    for path in (CMPL, CHAT):
        b = post(url, path, {**_base(path), "logprobs": 0} if path == CMPL else _base(path)).json()
        ids = b["choices"][0]["logprobs"]["tokens"] if path == CMPL else None
        out[path] = {"greedy": _text(b), "prompt_tokens": b["usage"]["prompt_tokens"], "tokens": ids}
    tok = offline.get_tokenizer()
    out["prompt_ids"] = {CMPL: tok.encode(PROMPT),
                         CHAT: tok.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True)}
    return out


def _honoured(url: str, path: str, name: str, value: Any, how: Any, facts: dict, offline: LLM) -> None:
    f = facts[path]
    body = _base(path)
    if how == "greedy_at_t1":  # a filter that leaves only the top token: sampling at t=1 gives greedy
        r = post(url, path, {**body, "temperature": 1.0, "seed": 3, name: value})
        assert r.status_code == 200 and _text(r.json()) == f["greedy"], (name, r.text)
        return
    if how in ("stop", "stop_token_ids"):
        _check_stop(url, path, name, value, f, facts["prompt_ids"][path], offline)
        return
    if how == "stream":
        chunks = sse_chunks(url, path, {**body, "stream_options": {"include_usage": True}})
        assert chunks[-1]["usage"]["completion_tokens"] == 12
        return
    if how == "engine":  # equal to the offline engine given the same value (which changes the text)
        base = {"max_tokens": 40, "temperature": 1.0 if name == "seed" else 0.0, "ignore_eos": True}
        prompt = {"prompt_token_ids": facts["prompt_ids"][path]}
        want, plain = ref(offline, prompt, **base, **{name: value}), ref(offline, prompt, **base, seed=8)
        r = post(url, path, {**body, **base, name: value})
        assert r.status_code == 200 and _text(r.json()) == want.outputs[0].text, (name, r.text)
        assert name == "skip_special_tokens" or want.outputs[0].text != plain.outputs[0].text
        return
    if name in STRUCTURED:
        body = {**body, "ignore_eos": False}  # structured output ends at its grammar's end
    if name == "top_logprobs":
        body = {**body, "logprobs": True}
    r = post(url, path, {**body, name: value})
    assert r.status_code == 200, (name, r.text)
    assert how(r.json(), f), (name, r.json())


def _check_stop(url, path, name, value, f, prompt_ids, offline) -> None:
    greedy = f["greedy"]
    body = _base(path)
    if name in ("stop", "include_stop_str_in_output"):
        stop = greedy[len(greedy) // 2:len(greedy) // 2 + 3]
        r = post(url, path, {**body, "stop": [stop], **({name: value} if name != "stop" else {})})
        want = greedy[: greedy.index(stop)] + (stop if name != "stop" else "")
        assert r.status_code == 200 and _text(r.json()) == want, (name, r.text, stop)
        return
    ids = ref(offline, {"prompt_token_ids": prompt_ids}, max_tokens=12, temperature=0,
              ignore_eos=True).outputs[0].token_ids
    stop_id = ids[3]
    first = ids.index(stop_id)
    extra = {"min_tokens": value} if name == "min_tokens" else {}
    r = post(url, path, {**body, "stop_token_ids": [stop_id], **extra})
    assert r.status_code == 200, r.text
    done = r.json()["usage"]["completion_tokens"]
    assert done == first + 1 if not extra else done > max(first + 1, value - 1), (name, done, ids)


@pytest.mark.parametrize("path,fields", [(CMPL, COMPLETION_FIELDS), (CHAT, CHAT_FIELDS)], ids=["completions", "chat"])
def test_every_vllm_request_field_is_honoured_or_refused_by_name(url, offline, facts, path, fields):
    refused, failures = [], []
    for name, (value, how) in fields.items():
        try:
            if how == REFUSE:
                r = post(url, path, {**_base(path), name: value})
                assert r.status_code == 400, (name, r.status_code, r.text)
                assert name in r.json()["error"]["message"] and r.json()["error"]["param"] == name, r.text
                refused.append(name)
            else:
                _honoured(url, path, name, value, how, facts, offline)
        except AssertionError as e:
            failures.append(f"{name}: {e}")
    assert not failures, "\n".join(failures)
    assert refused  # and a field no model knows is refused by name too
    r = post(url, path, {**_base(path), "frobnicate": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"
    # null and vLLM's neutral defaults count as not sent
    r = post(url, path, {**_base(path), "frobnicate": None, "use_beam_search": False, "length_penalty": 1.0})
    assert r.status_code == 200 and _text(r.json()) == facts[path]["greedy"]
