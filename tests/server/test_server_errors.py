"""Raw HTTP: every kind of bad input gets an OpenAI error body with the right status,
and the server answers the next good request normally."""
from __future__ import annotations

import json

import httpx
import pytest
from server_harness import ENGINE_KW, MODEL_NAME, ServerThread, engine, stories_with_chat_template

from treadle.server.app import build_app

pytestmark = pytest.mark.server  # starts processes (servers, workers)

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]
MAX_LEN = ENGINE_KW["max_model_len"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model = stories_with_chat_template(tmp_path_factory.mktemp("stories"))
    with engine(model) as client:
        yield client


@pytest.fixture(scope="module")
def url(llm):
    with ServerThread(build_app(llm, MODEL_NAME)) as srv:
        yield srv.url


def assert_healthy(url: str, path: str = CMPL) -> None:
    """A good request on the same endpoint succeeds, and /health says ok."""
    if path == CHAT:
        ok = httpx.post(url + CHAT, json={"messages": MSGS, "max_tokens": 2, "ignore_eos": True}, timeout=30)
    else:
        ok = httpx.post(url + CMPL, json={"prompt": "Once", "max_tokens": 2, "ignore_eos": True}, timeout=30)
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(url + "/health").status_code == 200


def assert_error(resp: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                           405: "invalid_request_error", 503: "service_unavailable_error"}[status]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err


BAD_BODIES = [
    # wrong types
    (CMPL, {"prompt": "x", "temperature": "hot"}, "temperature"),
    (CMPL, {"prompt": "x", "n": "2"}, "n"),
    (CMPL, {"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    (CMPL, {"prompt": "x", "logprobs": True}, "logprobs"),
    (CMPL, {"prompt": 5}, "prompt"),
    (CMPL, {"prompt": [1, "a"]}, "prompt"),
    (CMPL, {"prompt": "x", "stop": 5}, "stop"),
    (CMPL, {"prompt": "x", "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    (CMPL, {}, "prompt"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, None),
    (CHAT, {"messages": MSGS, "logprobs": 3}, "logprobs"),
    # out of range
    (CMPL, {"prompt": "x", "temperature": -0.5}, "temperature"),
    (CMPL, {"prompt": "x", "top_p": 0}, "top_p"),
    (CMPL, {"prompt": "x", "top_p": 1.5}, "top_p"),
    (CMPL, {"prompt": "x", "min_p": 2}, "min_p"),
    (CMPL, {"prompt": "x", "n": 0}, "n"),
    (CMPL, {"prompt": "x", "n": 100000}, "n"),
    (CMPL, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    (CMPL, {"prompt": "x", "logprobs": 21}, "logprobs"),
    (CMPL, {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    (CMPL, {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    (CMPL, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    (CMPL, {"prompt": "x", "repetition_penalty": 1e-300}, "repetition_penalty"),  # logit / penalty overflows
    # integers past 64 bits (the engine process's messages carry int64)
    (CMPL, {"prompt": [1, 2**70]}, None),
    (CMPL, {"prompt": "x", "seed": 2**65}, "seed"),
    (CMPL, {"prompt": "x", "seed": -(2**63) - 1}, "seed"),
    (CMPL, {"prompt": "x", "top_k": 2**70}, "top_k"),
    (CMPL, {"prompt": "x", "max_tokens": 2**70}, "max_tokens"),
    (CHAT, {"messages": MSGS, "max_completion_tokens": 2**70}, "max_completion_tokens"),
    (CHAT, {"messages": MSGS, "seed": 2**70}, "seed"),
    (CHAT, {"messages": MSGS, "max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT, {"messages": MSGS, "max_tokens": 0}, "max_tokens"),
    (CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"messages": MSGS, "top_logprobs": 2}, "top_logprobs"),
    # unsupported or empty
    (CMPL, {"prompt": "x", "logit_bias": {"5": 1.0}}, "logit_bias"),
    (CMPL, {"prompt": "x", "suffix": "tail"}, "suffix"),
    (CMPL, {"prompt": []}, "prompt"),
    (CHAT, {"messages": []}, "messages"),
    # too long, empty or unknown tokens (the engine's admission checks)
    (CMPL, {"prompt": "Once upon a time " * 200}, None),
    (CMPL, {"prompt": "x", "max_tokens": MAX_LEN}, None),
    (CMPL, {"prompt": [[1, 2], []]}, None),
    (CMPL, {"prompt": [1, 2, 100000]}, None),
    (CMPL, {"prompt": [-1]}, None),
    (CHAT, {"messages": [{"role": "user", "content": "hello " * 400}]}, None),
    ("/detokenize", {"tokens": [1, 99999]}, "tokens"),
    ("/tokenize", {}, "prompt"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_BODIES, ids=[f"{p}:{json.dumps(b)[:40]}" for p, b, _ in
                                                                      BAD_BODIES])
def test_bad_request_is_400_and_harmless(url, path, body, param):
    assert_error(httpx.post(url + path, json=body, timeout=30), 400, param)
    assert_healthy(url, path)


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'"text"', b'{"prompt": "x", "temperature": NaN}',
                                 b'{"prompt": "x", "top_p": Infinity}', b"\xff\xfe", b'{"prompt": "a\\ud800b"}',
                                 b'{"prompt": "x", "stop": ["\\udc00"]}'])
def test_malformed_body_is_400(url, raw):
    r = httpx.post(url + CMPL, content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert_error(r, 400)
    if raw in (b"{not json", b"\xff\xfe"):
        assert r.json()["error"]["code"] == "invalid_json"
    assert_healthy(url)


def test_unknown_model_is_404(url):
    assert_error(httpx.post(url + CMPL, json={"model": "gpt-9", "prompt": "x"}), 404, "model", "model_not_found")
    assert_error(httpx.post(url + CHAT, json={"model": "gpt-9", "messages": MSGS}), 404, "model")
    assert_healthy(url)
    assert_healthy(url, CHAT)


def test_unknown_route_and_wrong_method(url):
    assert_error(httpx.get(url + "/v1/nothing"), 404)
    assert_error(httpx.get(url + CMPL), 405)
    assert_healthy(url)


def test_api_key(llm):
    with ServerThread(build_app(llm, MODEL_NAME, api_key="sekrit")) as srv:
        body = {"prompt": "Once", "max_tokens": 2}
        assert_error(httpx.post(srv.url + CMPL, json=body), 401, code="invalid_api_key")
        assert_error(httpx.post(srv.url + CMPL, json=body, headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(httpx.get(srv.url + "/v1/models", headers={"Authorization": "sekrit"}), 401)
        ok = httpx.post(srv.url + CMPL, json=body, headers={"Authorization": "Bearer sekrit"}, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        assert httpx.get(srv.url + "/health").status_code == 200  # probes need no key
        assert httpx.get(srv.url + "/metrics").status_code == 200
