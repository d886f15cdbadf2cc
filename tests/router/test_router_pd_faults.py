"""The router over real processes on 127.0.0.1 (stories260k, one thread each: a kv_producer
holding unpulled KV for far longer than the tests, a kv_consumer, `treadle router`) when
things go wrong around it: clients that leave at random points of the prefill call leave the
producer holding nothing (freed at once, not at its timeout); the only decode instance frozen
for a few seconds (SIGSTOP/SIGCONT) costs no request a 503; a decode instance that is truly
gone is taken out after its consecutive failures and requests then fail clearly."""
from __future__ import annotations

import concurrent.futures
import json
import os
import random
import signal
import time

import httpx
import pytest
from router_harness import free_port, health, instance, router, router_metric, running, wait_in_rotation
from server_harness import engine_idle, metric_values, wait_until

pytestmark = pytest.mark.server

PRODUCER_TIMEOUT_S = 600.0  # the producer's own timeout never fires during these tests
# a window of 2+4+8 = 14 s for a 3 s freeze: a loaded 2-core machine answers health checks late
BACKOFF = ("--poll-interval", "0.2", "--retry-backoff", "2", "--max-failures", "4")
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
    front = router(tmp, "router", "--prefill", producer.url, "--decode", consumer.url, *BACKOFF)
    # the router of test_a_dead_decode_instance_...: started here, so that its decode
    # instance's back-off window runs out while the other tests run
    dead = f"http://127.0.0.1:{free_port()}"
    dead_front = router(tmp, "router-dead", "--prefill", producer.url, "--decode", dead, *BACKOFF)
    with running(producer, consumer, front):  # the router starts with the instances
        wait_in_rotation(front.url, producer, consumer)
        try:
            dead_front.start()  # after the producer is up: its first health check finds it healthy
            yield producer, consumer, front, (dead, dead_front)
        finally:
            dead_front.kill()


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
    producer, consumer, front, _ = pd
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
    try:
        wait_until(lambda: _held(producer.url) == 0, 20, "the leavers' KV freed")
    except AssertionError:
        raise AssertionError(f"{_held(producer.url):.0f} of {len(jobs)} requests' KV still held 20 s after the "
                             "producer went idle") from None
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


def _post(url: str, body: dict) -> tuple[int, str]:
    """(status, the text of a completion or the error's message); a stream is read to its end."""
    if not body["stream"]:
        resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
        data = resp.json()
        return resp.status_code, data["choices"][0]["text"] if resp.status_code == 200 else data["error"]["message"]
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
        if resp.status_code != 200:
            return resp.status_code, json.loads(resp.read())["error"]["message"]
        events = [json.loads(ln[6:]) for ln in resp.iter_lines() if ln.startswith("data: {")]
    return 200, "".join(e["choices"][0]["text"] for e in events if e.get("choices"))


def test_freezing_the_only_decode_instance_costs_no_request_a_503(pd):
    """SIGSTOP on the decode instance (its server and engine) while requests arrive, until the
    router's health check has failed (the instance backs off) and a few more have arrived: every
    request is answered once it is resumed, with the output it gives when nothing goes wrong."""
    producer, consumer, front, _ = pd
    want = {p: _post(consumer.url, _body(p))[1] for p in PROMPTS}
    jobs = [_body(PROMPTS[i % len(PROMPTS)], stream=i % 2 == 1) for i in range(14)]
    noticed = []

    def submit(batch: list[dict]) -> None:
        for job in batch:  # one every 0.25 s
            futures.append(ex.submit(_post, front.url, job))
            time.sleep(0.25)
            noticed.append(router_metric(front.url, "treadle:router_instance_failures", role="decode"))

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
        os.killpg(consumer.proc.pid, signal.SIGSTOP)
        try:
            futures: list[concurrent.futures.Future] = []
            submit(jobs[:7])  # before the router notices
            # a health check fails after the poll's 2 s timeout, later on a loaded machine (a poll
            # that was reading /load when the instance stopped waits out that timeout first)
            wait_until(lambda: router_metric(front.url, "treadle:router_instance_failures", role="decode") >= 1, 20,
                       "the router to notice the frozen instance", interval=0.1)
            noticed.append(router_metric(front.url, "treadle:router_instance_failures", role="decode"))
            submit(jobs[7:])  # after it noticed
        finally:
            os.killpg(consumer.proc.pid, signal.SIGCONT)
        while not all(f.done() for f in futures):
            time.sleep(0.25)
            noticed.append(router_metric(front.url, "treadle:router_instance_failures", role="decode"))
        got = [f.result(timeout=60) for f in futures]
    assert max(noticed) >= 1  # the router saw it fail (and requests kept arriving after that)
    assert [status for status, _ in got] == [200] * len(jobs), ([m for s, m in got if s != 200], noticed)
    assert [text for _, text in got] == [want[job["prompt"]] for job in jobs]
    wait_until(lambda: router_metric(front.url, "treadle:router_instance_failures", role="decode") == 0, 10,
               "the decode instance back in rotation")
    wait_until(lambda: _held(producer.url) == 0 and engine_idle(consumer.url), 20, "every KV pulled, consumer idle")


@pytest.mark.slow  # the whole back-off window (14 s; its router starts with the module's instances)
def test_a_dead_decode_instance_is_taken_out_and_requests_fail_clearly(pd):
    """A decode URL nobody listens on: it backs off, then leaves rotation after --max-failures;
    requests then get a 503 at once naming it, and the producer frees the prompts it computed."""
    producer, _, _, (dead, front) = pd
    wait_until(lambda: front.exited() or health(front.url) is not None, 120, "the router to start")
    assert not front.exited(), front.log.read_text()[-3000:]
    wait_until(lambda: health(front.url) == 503, 40, "the router to give the dead instance up")
    released = _counter(producer.url, "released")
    for stream in (False, True):
        t0 = time.monotonic()
        status, message = _post(front.url, _body(PROMPTS[0], stream=stream))
        assert status == 503 and time.monotonic() - t0 < 5
        assert f"{dead} is out of rotation after 4 consecutive failures" in message, message
    wait_until(lambda: _counter(producer.url, "released") == released + 2, 10, "the prefilled KV released")
    assert _held(producer.url) == 0
