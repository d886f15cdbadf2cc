"""P/D disaggregation over HTTP with real engine-core processes on 127.0.0.1 (stories260k, one
thread each), driven directly (no router): a producer (kv_producer) and a consumer
(kv_consumer) give the greedy output of a colocated instance through the openai client,
streaming and not, for both connectors; a failed or slow transfer is recomputed (counted);
unpulled producer blocks are freed after the timeout; a client that leaves while its KV is
being pulled frees the consumer's blocks; a client that leaves between prefill and decode, or a
decode step that never starts behind the router, frees the producer's blocks at once (its
timeout set far beyond the test); GET /load reports each instance's role."""
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
from router_harness import router, running
from server_harness import (
    ENGINE_KW,
    MODEL_NAME,
    HookedEngineFactory,
    ServerThread,
    StepControl,
    engine_idle,
    metric_values,
    stories_with_chat_template,
    wait_until,
)

from treadle.engine.client.multi_process import EngineCoreClient
from treadle.engine.llm_engine import LLMEngine
from treadle.server.app import build_app

pytestmark = pytest.mark.server  # starts processes (servers, workers)

PROMPT = "Once upon a time there was a little girl named Lily. She loved to play"
PRODUCER_TIMEOUT_S = 5.0  # long enough for a pull on a busy 2-core machine


def start(model_dir: Path, kv: dict[str, Any] | None, control: StepControl | None = None,
          **engine_kw: Any) -> EngineCoreClient:
    """An engine-core process (one torch thread) for ``model_dir``; ``control``: its steps can be slowed."""
    kw = {**ENGINE_KW, "kv_transfer_config": kv, **engine_kw}
    factory = LLMEngine.from_args if control is None else HookedEngineFactory(control)
    return EngineCoreClient(functools.partial(factory, str(model_dir), **kw), threads=1)


@contextlib.contextmanager
def instances(model_dir: Path, *kvs: dict[str, Any] | None,
              options: list[dict[str, Any]] | None = None) -> Iterator[list[str]]:
    """Servers (uvicorn thread + engine-core process each), started side by side; yields URLs.
    ``options``: per server, more keyword arguments of ``start``."""
    opts = options or [{} for _ in kvs]
    with ThreadPoolExecutor(len(kvs)) as pool:
        futures = [pool.submit(start, model_dir, kv, **opt) for kv, opt in zip(kvs, opts, strict=True)]
    llms = [f.result() for f in futures if f.exception() is None]
    try:
        if len(llms) < len(kvs):
            raise next(f.exception() for f in futures if f.exception() is not None)  # type: ignore[misc]
        with contextlib.ExitStack() as stack:
            yield [stack.enter_context(ServerThread(build_app(llm, MODEL_NAME))).url for llm in llms]
    finally:  # side by side too: each engine process takes a second or two to stop
        with ThreadPoolExecutor(max(len(llms), 1)) as pool:
            list(pool.map(lambda llm: llm.shutdown(), llms))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return stories_with_chat_template(tmp_path_factory.mktemp("stories"))


@pytest.fixture(scope="module")
def colocated(model_dir: Path) -> Iterator[str]:
    """A plain instance (no KV transfer): the reference of both connectors' pairs (one engine
    process, not one per connector; the tests only read its greedy output and its /load)."""
    with instances(model_dir, None) as urls:
        yield urls[0]


@pytest.fixture(scope="module", params=["tcp", pytest.param("shm", marks=pytest.mark.slow)])
def pd(request: pytest.FixtureRequest, model_dir: Path, colocated: str) -> Iterator[tuple[str, str, str]]:
    """(producer, consumer, colocated) URLs; producer and consumer joined by the parameter's connector."""
    conn = request.param
    with instances(model_dir, {"kv_connector": conn, "kv_role": "kv_producer",
                               "producer_block_timeout_s": PRODUCER_TIMEOUT_S},
                   {"kv_connector": conn, "kv_role": "kv_consumer", "transfer_timeout_s": 1.0}) as urls:
        yield urls[0], urls[1], colocated


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
        assert set(load) == {"waiting_prompt_tokens", "running", "waiting", "kv_usage", "role",
                             "predicted_remaining_tokens", "max_num_seqs"}
        assert load["role"] == role and load["running"] == 0 and load["waiting_prompt_tokens"] == 0
        assert load["predicted_remaining_tokens"] in (None, 0)  # nothing running: no predicted work
        assert isinstance(load["max_num_seqs"], int) and load["max_num_seqs"] > 0  # the router queue's slots


# -- a client that leaves between prefill and decode ------------------------------------------------
LONG_TIMEOUT_S = 600.0  # the producer's own timeout never fires during these tests
CONSUMER_MAX_LEN = 128  # smaller than the producer's: a long max_tokens is a 400 at the decode step only


@pytest.fixture(scope="module")
def held(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str, StepControl]]:
    """(producer, consumer, router URL, the producer's step control): tcp, the producer holding
    blocks for LONG_TIMEOUT_S, a `treadle router` subprocess in front of both."""
    control = StepControl()
    kvs = ({"kv_connector": "tcp", "kv_role": "kv_producer", "producer_block_timeout_s": LONG_TIMEOUT_S},
           {"kv_connector": "tcp", "kv_role": "kv_consumer", "transfer_timeout_s": 60.0})
    with instances(model_dir, *kvs, options=[{"control": control}, {"max_model_len": CONSUMER_MAX_LEN}]) as urls:
        front = router(tmp_path_factory.mktemp("router"), "router", "--prefill", urls[0], "--decode", urls[1],
                       "--poll-interval", "0.2")
        with running(front):
            yield urls[0], urls[1], front.url, control


def test_client_leaving_between_prefill_and_decode_frees_the_producer_at_once(held) -> None:
    """The consumer's pull waits for the producer (its steps slowed, the KV is not servable
    yet) when the client leaves: the consumer cancels the pull and releases the producer's KV."""
    producer, consumer, _, control = held
    released, pulled = counter(producer, "released"), counter(producer, "pulled")
    control.set_step_delay(1.0)  # each producer step starts 1 s late: the KV is servable 1 s after the answer
    try:
        params = prefill(producer)
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "kv_transfer_params": params}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{consumer}/v1/completions", json=body, timeout=0.3)
        wait_until(lambda: engine_idle(producer), 20, "the producer's blocks freed (its timeout is 600 s)")
    finally:
        control.set_step_delay(0.0)
    assert counter(producer, "released") == released + 1 and counter(producer, "pulled") == pulled
    assert metric_values(producer)["treadle:kv_transfer_held_requests"] == 0
    wait_until(lambda: engine_idle(consumer), 10, "consumer idle, every block free")


def test_router_releases_the_producer_when_no_decode_step_starts(held) -> None:
    """The decode instance refuses the request (max_tokens past its max_model_len) after the
    producer computed the prompt: the router tells the producer to free it."""
    producer, consumer, front, _ = held
    released = counter(producer, "released")
    with pytest.raises(openai.BadRequestError):
        client(front).completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=CONSUMER_MAX_LEN, temperature=0)
    wait_until(lambda: engine_idle(producer), 20, "the producer's blocks freed (its timeout is 600 s)")
    assert counter(producer, "released") == released + 1
    assert metric_values(front).get("treadle:router_kv_releases_total") == 1
    # a request both can take still goes through, and its KV is pulled
    assert complete(front, max_tokens=8) == complete(consumer, max_tokens=8)
    wait_until(lambda: engine_idle(producer) and engine_idle(consumer), 20, "both sides idle")


def test_echoed_prompt_logprobs_through_the_router(held) -> None:
    """echo with logprobs asks for the prompt's own logprobs, which a loaded KV cannot give: the
    router sends such a request straight to the decode instance, which computes the prompt, and
    the answer equals that instance's own (the prompt's entries were all None through P/D)."""
    producer, consumer, front, _ = held
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1)
    pulled = counter(producer, "pulled")
    got = client(front).completions.create(**kw).choices[0].logprobs
    want = client(consumer).completions.create(**kw).choices[0].logprobs
    assert got.tokens == want.tokens and got.token_logprobs == pytest.approx(want.token_logprobs, abs=1e-5)
    assert got.token_logprobs[0] is None and all(lp is not None for lp in got.token_logprobs[1:])
    assert counter(producer, "pulled") == pulled  # no prefill on the producer
