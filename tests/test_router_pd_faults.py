"""The router over real processes on 127.0.0.1 (stories260k, one thread each: a kv_producer
holding unpulled KV for far longer than the tests, a kv_consumer, `treadle router`) when
things go wrong around it: clients that leave at random points of the prefill call leave the
producer holding nothing (freed at once, not at its timeout); the only decode instance frozen
for a few seconds (SIGSTOP/SIGCONT) costs no request a 503; a decode instance that is truly
gone is taken out after its consecutive failures and requests then fail clearly."""
from __future__ import annotations

import concurrent.futures
import json
import random
import time

import httpx
import pytest
from router_harness import instance, router, router_metric, running
from server_harness import engine_idle, metric_values, wait_until

pytestmark = pytest.mark.server

PRODUCER_TIMEOUT_S = 600.0  # the producer's own timeout never fires during these tests
BACKOFF = ("--poll-interval", "0.2", "--retry-backoff", "0.5", "--max-failures", "4")  # window 0.5+1+2 = 3.5 s
PROMPTS = ["Once upon a time there was a little girl named Lily. She loved to play", "The little dog",
           "Lily and Ben went to the park", "One day, a bird"]


def _kv(role: str, **more: float) -> tuple[str, str]:
    return "--kv-transfer-config", json.dumps({"kv_connector": "tcp", "kv_role": role, **more})


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router-pd-faults")
    producer = instance(tmp, "producer", 0.02, "stories260k",
                        *_kv("kv_producer", producer_block_timeout_s=PRODUCER_TIMEOUT_S))
    consumer = instance(tmp, "consumer", 0.02, "stories260k", *_kv("kv_consumer"))
    front = router(tmp, "router", "--prefill", producer.url, "--decode", consumer.url, "--poll-interval", "0.2")
    with running(producer, consumer), running(front):
        yield producer, consumer, front


def _held(url: str) -> float:
    return metric_values(url)["treadle:kv_transfer_held_requests"]


def _counter(url: str, name: str) -> float:
    return metric_values(url).get(f"treadle:kv_transfer_{name}_total", 0.0)


def _body(prompt: str, stream: bool = False, max_tokens: int = 8) -> dict:
    return {"model": "stories260k", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def _leave_after(url: str, body: dict, seconds: float) -> None:
    """Send ``body`` and hang up after ``seconds`` (whatever the router has done by then)."""
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=seconds) as resp:
            for _ in resp.iter_bytes():
                pass
    except httpx.TimeoutException:
        pass


def test_clients_leaving_during_the_prefill_call_leave_nothing_held(pd):
    producer, consumer, front = pd
    t0 = time.monotonic()
    httpx.post(producer.url + "/v1/completions", json=_body(PROMPTS[0], max_tokens=1), timeout=30)
    prefill_s = time.monotonic() - t0  # about one prefill call, idle producer
    expired, released = _counter(producer.url, "expired"), _counter(producer.url, "released")
    rng = random.Random(34)
    jobs = [(_body(f"{rng.choice(PROMPTS)} {i}", stream=i % 2 == 1), rng.uniform(0.0, 4 * prefill_s))
            for i in range(48)]
    with concurrent.futures.ThreadPoolExecutor(12) as ex:
        list(ex.map(lambda job: _leave_after(front.url, *job), jobs))
    wait_until(lambda: (m := metric_values(producer.url))["treadle:num_requests_running"] == 0
               and m["treadle:num_requests_waiting"] == 0, 20, "the producer done computing")
    settled = time.monotonic()
    wait_until(lambda: _held(producer.url) == 0, 20, "the leavers' KV freed")
    freed_s = time.monotonic() - settled
    assert freed_s < 1.5, f"held KV freed {freed_s:.1f} s after the producer went idle"
    assert _counter(producer.url, "expired") == expired  # nothing waited for the timeout
    print(f"prefill call {prefill_s:.3f} s; released {_counter(producer.url, 'released') - released:.0f} "
          f"of {len(jobs)}; freed {freed_s:.2f} s after the producer went idle")
    assert router_metric(front.url, "treadle:router_kv_releases_total") >= 1
    wait_until(lambda: engine_idle(consumer.url), 10, "the consumer idle, every block free")
    # the router still serves whole requests, their KV pulled
    pulled = _counter(producer.url, "pulled")
    assert httpx.post(front.url + "/v1/completions", json=_body(PROMPTS[1]), timeout=60).status_code == 200
    wait_until(lambda: _counter(producer.url, "pulled") == pulled + 1, 10, "the KV pulled")
