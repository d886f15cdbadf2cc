"""`treadle router --prefill P --decode D` over real processes on 127.0.0.1 (stories260k, one
thread each): a kv_producer, a kv_consumer (tcp connector), a colocated instance as the
reference, and the router; the official openai client throughout."""
from __future__ import annotations

import concurrent.futures
import json

import openai
import pytest
from router_harness import instance, router, router_metric, running, upstream_count, wait_in_rotation
from server_harness import engine_idle, metric_values, stories_with_chat_template, wait_until

pytestmark = [pytest.mark.server, pytest.mark.slow]  # four servers to start

PROMPTS = ["Once upon a time there was a little girl named Lily. She loved to play", "The little dog",
           "Lily and Ben went to the park", "One day, a bird"]
STEP_DELAY = 0.01  # each engine step sleeps this long, so requests are still in flight when the producer dies


def _kv(role: str) -> tuple[str, str]:
    return "--kv-transfer-config", json.dumps({"kv_connector": "tcp", "kv_role": role})


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router-pd")
    model = str(stories_with_chat_template(tmp / "model"))
    colocated = instance(tmp, "colocated", 0.0, model)
    producer = instance(tmp, "producer", STEP_DELAY, model, *_kv("kv_producer"))
    consumer = instance(tmp, "consumer", STEP_DELAY, model, *_kv("kv_consumer"))
    front = router(tmp, "router", "--prefill", producer.url, "--decode", consumer.url, "--poll-interval", "0.2")
    with running(colocated, producer, consumer, front):  # the router starts with the instances
        wait_in_rotation(front.url, producer, consumer)
        yield colocated, producer, consumer, front, model


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def _complete(url: str, model: str, prompt: str, stream: bool, max_tokens: int = 24) -> str:
    kw = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
    if not stream:
        return _client(url).completions.create(**kw).choices[0].text
    return "".join(c.choices[0].text for c in _client(url).completions.create(**kw, stream=True) if c.choices)


def _chat(url: str, model: str, prompt: str, stream: bool, max_tokens: int = 24) -> str:
    kw = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0)
    if not stream:
        return _client(url).chat.completions.create(**kw).choices[0].message.content or ""
    chunks = _client(url).chat.completions.create(**kw, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _kv_counter(url: str, name: str) -> float:
    return metric_values(url).get(f"treadle:kv_transfer_{name}_total", 0.0)


@pytest.mark.parametrize("call", [_complete, _chat], ids=["completions", "chat"])
def test_prefill_then_decode_gives_the_colocated_greedy_output(pd, call):
    colocated, producer, consumer, front, model = pd
    loads = _kv_counter(consumer.url, "loads")
    expected = [call(colocated.url, model, p, False) for p in PROMPTS]
    jobs = [(p, stream) for p in PROMPTS for stream in (False, True)]
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda job: call(front.url, model, *job), jobs))
    assert got == [e for e in expected for _ in (False, True)]
    assert upstream_count(front.url, producer.url) >= len(jobs) and upstream_count(front.url, consumer.url) >= len(jobs)
    assert _kv_counter(consumer.url, "loads") == loads + len(jobs)  # every prompt's KV came from the producer
    assert router_metric(front.url, "treadle:router_prefill_fallbacks_total") == 0
    wait_until(lambda: engine_idle(producer.url) and engine_idle(consumer.url), 15, "both sides idle")


def test_killing_the_prefill_instance_mid_run(pd):
    """Requests in flight when the producer dies end correctly (the consumer recomputes a
    prompt it cannot pull; the router sends prompts the producer cannot take to the consumer)
    or with a clear error; nothing hangs; the consumer frees every block."""
    colocated, producer, consumer, front, model = pd
    prompts = [f"{p} {i}" for i in range(3) for p in PROMPTS]
    expected = {p: _complete(colocated.url, model, p, False, 60) for p in prompts}
    before = upstream_count(front.url, producer.url)

    def run(prompt: str) -> str | Exception:
        try:
            return _complete(front.url, model, prompt, True, 60)
        except openai.APIError as e:
            return e

    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        futures = {ex.submit(run, p): p for p in prompts}
        wait_until(lambda: upstream_count(front.url, producer.url) >= before + 3, 60, "some prompts prefilled")
        producer.kill()
        results = {futures[f]: f.result(timeout=120) for f in concurrent.futures.as_completed(futures, timeout=180)}
    errors = [r for r in results.values() if isinstance(r, Exception)]
    assert all(r == expected[p] for p, r in results.items() if not isinstance(r, Exception))
    assert all(e.message for e in errors)  # an OpenAI error with a message, not a hang
    assert len(errors) < len(prompts)
    assert _complete(front.url, model, PROMPTS[0], False) == _complete(colocated.url, model, PROMPTS[0], False)
    assert router_metric(front.url, "treadle:router_prefill_fallbacks_total") >= 1
    wait_until(lambda: engine_idle(consumer.url), 30, "the consumer to free every block")
