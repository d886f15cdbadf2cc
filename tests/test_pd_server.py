"""P/D disaggregation over HTTP with real engine-core processes on 127.0.0.1 (stories260k, one
thread each), driven directly (no router): a producer (kv_producer) and a consumer
(kv_consumer) give the greedy output of a colocated instance through the openai client,
streaming and not, for both connectors; a failed or slow transfer is recomputed (counted);
unpulled producer blocks are freed after the timeout; a client that leaves while its KV is
being pulled frees the consumer's blocks; GET /load reports each instance's role."""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import zmq
from server_harness import (
    ENGINE_KW,
    MODEL_NAME,
    ServerThread,
    engine_idle,
    metric_values,
    stories_with_chat_template,
    wait_until,
)

from treadle.engine.core_client import EngineCoreClient
from treadle.engine.llm_engine import LLMEngine
from treadle.server import build_app

PROMPT = "Once upon a time there was a little girl named Lily. She loved to play"
PRODUCER_TIMEOUT_S = 5.0  # long enough for a pull on a busy 2-core machine


def start(model_dir: Path, kv: dict[str, Any] | None) -> EngineCoreClient:
    """An engine-core process (one torch thread) for ``model_dir``."""
    kw = {**ENGINE_KW, "kv_transfer_config": kv}
    return EngineCoreClient(str(model_dir), functools.partial(LLMEngine.from_args, str(model_dir), **kw), threads=1)


@contextlib.contextmanager
def instances(model_dir: Path, *kvs: dict[str, Any] | None) -> Iterator[list[str]]:
    """Servers (uvicorn thread + engine-core process each), started side by side; yields URLs."""
    with ThreadPoolExecutor(len(kvs)) as pool:
        futures = [pool.submit(start, model_dir, kv) for kv in kvs]
    llms = [f.result() for f in futures if f.exception() is None]
    try:
        if len(llms) < len(kvs):
            raise next(f.exception() for f in futures if f.exception() is not None)  # type: ignore[misc]
        with contextlib.ExitStack() as stack:
            yield [stack.enter_context(ServerThread(build_app(llm, MODEL_NAME))).url for llm in llms]
    finally:
        for llm in llms:
            llm.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return stories_with_chat_template(tmp_path_factory.mktemp("stories"))


@pytest.fixture(scope="module", params=["tcp", pytest.param("shm", marks=pytest.mark.slow)])
def pd(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[tuple[str, str, str]]:
    """(producer, consumer, colocated) URLs; producer and consumer joined by the parameter's connector."""
    conn = request.param
    with instances(model_dir, {"kv_connector": conn, "kv_role": "kv_producer",
                               "producer_block_timeout_s": PRODUCER_TIMEOUT_S},
                   {"kv_connector": conn, "kv_role": "kv_consumer", "transfer_timeout_s": 1.0}, None) as urls:
        yield urls[0], urls[1], urls[2]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def prefill(producer: str, chat: bool = False) -> dict[str, Any]:
    """What a router does first: the request with max_tokens 1 and do_remote_decode."""
    extra = {"kv_transfer_params": {"do_remote_decode": True}}
    if chat:
        resp = client(producer).chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": PROMPT}],
                                                        max_tokens=1, temperature=0, extra_body=extra)
    else:
        resp = client(producer).completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, temperature=0,
                                                   extra_body=extra)
    params = resp.model_extra["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["num_tokens"] > 1
    return params


def complete(url: str, stream: bool = False, kv: dict[str, Any] | None = None, max_tokens: int = 24) -> str:
    extra = {} if kv is None else {"kv_transfer_params": kv}
    c = client(url)
    if stream:
        chunks = c.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                      stream=True, extra_body=extra)
        return "".join(ch.choices[0].text for ch in chunks if ch.choices)
    return c.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                extra_body=extra).choices[0].text


def counter(url: str, name: str) -> float:
    return metric_values(url).get(f"treadle:kv_transfer_{name}_total", 0.0)


def test_disaggregated_output_equals_colocated(pd: tuple[str, str, str]) -> None:
    producer, consumer, colocated = pd
    loads = counter(consumer, "loads")
    for stream in (False, True):
        assert complete(consumer, stream, prefill(producer)) == complete(colocated, stream)
    chat_kv = prefill(producer, chat=True)
    msgs = [{"role": "user", "content": PROMPT}]
    want = client(colocated).chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=16, temperature=0)
    got = client(consumer).chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=16, temperature=0,
                                                   stream=True, extra_body={"kv_transfer_params": chat_kv})
    assert "".join(ch.choices[0].delta.content or "" for ch in got if ch.choices) == want.choices[0].message.content
    assert counter(consumer, "loads") == loads + 3 and counter(consumer, "recomputes") == 0
    wait_until(lambda: engine_idle(producer) and engine_idle(consumer), 10, "both sides idle, every block free")
    assert counter(producer, "pulled") >= 3


def test_failed_or_slow_transfer_is_recomputed(pd: tuple[str, str, str]) -> None:
    producer, consumer, colocated = pd
    want = complete(colocated)
    before = counter(consumer, "recomputes")
    unknown = {**prefill(producer), "remote_request_id": "nobody-holds-this"}
    assert complete(consumer, kv=unknown) == want
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # a producer that takes the pull and never answers
    try:
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        assert complete(consumer, kv={**unknown, "remote_port": port}) == want  # after transfer_timeout_s
    finally:
        silent.close(0)
        ctx.term()
    assert counter(consumer, "recomputes") == before + 2
    wait_until(lambda: engine_idle(consumer), 10, "consumer idle, every block free")


def test_unpulled_producer_blocks_are_freed_after_the_timeout(pd: tuple[str, str, str]) -> None:
    producer = pd[0]
    expired = counter(producer, "expired")
    held = metric_values(producer)["treadle:kv_transfer_held_requests"]  # earlier tests may leave some
    prefill(producer)  # a client that left between prefill and decode: nobody pulls
    assert metric_values(producer)["treadle:kv_transfer_held_requests"] == held + 1
    assert not engine_idle(producer)
    wait_until(lambda: engine_idle(producer), PRODUCER_TIMEOUT_S + 5, "the producer's blocks freed")
    assert counter(producer, "expired") >= expired + 1
    assert metric_values(producer)["treadle:kv_transfer_held_requests"] == 0


def test_client_leaving_during_the_pull_frees_the_consumer(pd: tuple[str, str, str]) -> None:
    consumer = pd[1]
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    try:
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        kv = {"do_remote_prefill": True, "remote_engine_id": "x", "remote_host": "127.0.0.1", "remote_port": port,
              "remote_request_id": "r", "num_tokens": 17}
        body = {"model": MODEL_NAME, "prompt": [1] + list(range(300, 316)), "max_tokens": 8, "kv_transfer_params": kv}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{consumer}/v1/completions", json=body, timeout=0.3)
        wait_until(lambda: metric_values(consumer)["treadle:kv_transfer_loading_requests"] == 0, 10, "pull ended")
        wait_until(lambda: engine_idle(consumer), 10, "consumer idle, every block free")
    finally:
        silent.close(0)
        ctx.term()


def test_load_endpoint(pd: tuple[str, str, str]) -> None:
    producer, consumer, colocated = pd
    for url, role in ((producer, "kv_producer"), (consumer, "kv_consumer"), (colocated, None)):
        load = httpx.get(f"{url}/load", timeout=10).json()
        assert set(load) == {"waiting_prompt_tokens", "running", "waiting", "kv_usage", "role"}
        assert load["role"] == role and load["running"] == 0 and load["waiting_prompt_tokens"] == 0
