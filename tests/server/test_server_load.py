"""Concurrency, client disconnects and metrics against one live server."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from server_harness import MODEL_NAME, StepControl, engine_idle, metric_values, serve, wait_until

from treadle.loaders.resolve import resolve_model

pytestmark = pytest.mark.server  # starts processes (servers, workers)

CMPL = "/v1/completions"


@pytest.fixture(scope="module")
def control():
    return StepControl()


@pytest.fixture(scope="module")
def server(control):
    with serve(resolve_model("stories260k"), control=control) as (srv, _):
        yield srv


@pytest.fixture
def slow_steps(control):
    """Steps take 100 ms, so a client can leave mid-generation, and "within a step or two"
    has a meaning even on a busy machine."""
    control.set_step_delay(0.1)
    yield
    control.set_step_delay(0)


def test_64_concurrent_streams_complete(server):
    alone = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120).completions.create(
        model=MODEL_NAME, prompt="Once upon a time", max_tokens=15, temperature=0, extra_body={"ignore_eos": True})
    reference = alone.choices[0].text  # the prompt's greedy text in a batch of one
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(i: int) -> tuple[int, str, int, int]:
        stream = await client.completions.create(
            model=MODEL_NAME, prompt="Once upon a time", max_tokens=8 + i % 8, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, chunks, usage = "", 0, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for c in chunk.choices:
                text += c.text
                chunks += 1
        return 8 + i % 8, text, chunks, usage.completion_tokens

    async def run_all() -> list[tuple[int, str, int, int]]:
        try:
            return await asyncio.gather(*[one(i) for i in range(64)])
        finally:
            await client.close()

    results = asyncio.run(run_all())
    for max_tokens, text, chunks, completion_tokens in results:
        assert completion_tokens == max_tokens
        assert chunks == max_tokens  # one chunk per generated token
        assert reference.startswith(text)  # greedy: the tokens it gets alone, whatever the batch
    assert max(results)[1] == reference
    wait_until(lambda: engine_idle(server.url), 10, "engine idle")


def _aborted(url: str) -> float:
    return metric_values(url).get("treadle:request_success_total{finished_reason=abort}", 0.0)


def test_streaming_clients_that_leave_are_aborted(server, slow_steps):
    before = _aborted(server.url)
    body = {"prompt": "Once upon a time", "max_tokens": 300, "stream": True, "ignore_eos": True}
    for _ in range(4):
        with httpx.Client(timeout=30) as client, client.stream("POST", server.url + CMPL, json=body) as resp:
            assert resp.status_code == 200
            lines = (line for line in resp.iter_lines() if line.startswith("data: "))
            first = json.loads(next(lines)[6:])
            assert first["choices"][0]["finish_reason"] is None
            steps = metric_values(server.url)["treadle:engine_steps_total"]
        # the connection is dropped mid-stream; the request leaves within a step or two
        wait_until(lambda: engine_idle(server.url), 10, "the aborted request to leave the engine")
        assert metric_values(server.url)["treadle:engine_steps_total"] - steps <= 4
    assert _aborted(server.url) == before + 4


def test_non_streaming_client_that_leaves_is_aborted(server, slow_steps):
    before = _aborted(server.url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + CMPL, json={"prompt": "Once", "max_tokens": 300, "ignore_eos": True}, timeout=0.5)
    wait_until(lambda: engine_idle(server.url), 10, "aborted request to leave the engine")
    assert _aborted(server.url) == before + 1


def test_metrics_count_tokens_and_latencies(server):
    before = metric_values(server.url)
    r = httpx.post(server.url + CMPL, json={"prompt": ["Once", "The dog"], "n": 2, "max_tokens": 5,
                                            "ignore_eos": True, "seed": 1}, timeout=30).json()
    after = metric_values(server.url)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("treadle:generation_tokens_total") == r["usage"]["completion_tokens"] == 20
    assert delta("treadle:prompt_tokens_total") == r["usage"]["prompt_tokens"]
    assert delta("treadle:request_success_total{finished_reason=length}") == 4
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds"):
        assert delta(f"treadle:{hist}_count") == 2
    assert after["treadle:kv_cache_total_blocks"] > 0 and after["treadle:engine_alive"] == 1
    assert "treadle:num_preemptions_total" in after and "treadle:kv_cache_usage_perc" in after
    assert after["treadle:engine_steps_total"] > before["treadle:engine_steps_total"]
