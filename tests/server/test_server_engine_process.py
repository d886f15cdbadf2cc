"""`treadle serve` as real processes: the API server and its engine-core process.
Same greedy output as the offline LLM through the openai client; a client that leaves
is aborted inside the engine process (its blocks come back, as /metrics shows); a
SIGKILLed engine fails in-flight requests and turns /health 503 within seconds; an
engine whose API server dies exits by itself."""
from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from server_harness import engine_idle, metric_values, wait_until
from test_server_lifecycle import _free_port, _health, kill_group, serve_subprocess, sse_events

from treadle import LLM, SamplingParams

pytestmark = pytest.mark.server  # starts processes (servers, workers)

CMPL = "/v1/completions"
PROMPTS = ["Once upon a time", "The little dog"]


def engine_children(pid: int) -> list[int]:
    """Direct children of ``pid`` started by multiprocessing spawn (the engine process)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.fixture
def server():
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve_subprocess(port, 0.02)
    try:
        wait_until(lambda: proc.poll() is not None or _health(url) == 200, 120, "server start")
        assert proc.poll() is None, "the server exited at start-up"
        yield proc, url
    finally:
        kill_group(proc)


def test_engine_process_serves_like_offline_and_dies_loudly(server):
    proc, url = server
    [engine_pid] = engine_children(proc.pid)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    resp = client.completions.create(model="stories260k", prompt=PROMPTS, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    ref = LLM("stories260k", max_model_len=512).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [c.text for c in resp.choices] == [r.outputs[0].text for r in ref]

    # a streaming client that leaves is aborted inside the engine process: its blocks come back
    body = {"prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + CMPL, json=body, timeout=30) as r:
        events = sse_events(r)  # (kept: dropping the generator would close the connection)
        assert json.loads(next(events))["choices"][0]["finish_reason"] is None
        m = metric_values(url)
        assert m["treadle:kv_cache_free_blocks"] < m["treadle:kv_cache_total_blocks"]
    wait_until(lambda: engine_idle(url), 10, "the engine process to free the aborted request")
    assert metric_values(url)["treadle:request_success_total{finished_reason=abort}"] == 1

    # the engine process is killed mid-stream: the stream ends with an error, health turns 503
    with httpx.stream("POST", url + CMPL, json=body, timeout=30) as r:
        events = sse_events(r)
        assert json.loads(next(events))["choices"]
        killed = time.monotonic()
        os.kill(engine_pid, signal.SIGKILL)
        rest = list(events)
    assert rest[-1] == "[DONE]" and json.loads(rest[-2])["error"]["code"] == "engine_error"
    wait_until(lambda: _health(url) == 503, 5, "/health to report the dead engine")
    assert time.monotonic() - killed < 5
    late = httpx.post(url + CMPL, json={"prompt": "Once", "max_tokens": 2}, timeout=10)
    assert late.status_code == 503 and late.json()["error"]["code"] == "engine_dead"
    assert metric_values(url)["treadle:engine_alive"] == 0
    assert proc.poll() is None  # the API server stays up, reporting the failure


def test_engine_process_exits_when_the_api_server_dies(server):
    proc, _ = server
    [engine_pid] = engine_children(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    wait_until(lambda: not alive(engine_pid), 10, "the orphaned engine process to exit")


def test_shutdown_after_the_engine_process_died_neither_warns_nor_signals(caplog: pytest.LogCaptureFixture) -> None:
    """The reader thread and shutdown both wait on a dead engine process: only one may reap it;
    the other used to see it as alive, warn that it 'did not stop within 10 s' and kill a PID
    that was gone. Run a few times: which thread waits first is up to the scheduler."""
    from server_harness import start_engine

    from treadle.loaders.resolve import resolve_model

    with ThreadPoolExecutor(3) as pool:  # the three engines start side by side
        futures = [pool.submit(start_engine, resolve_model("stories260k")) for _ in range(3)]
    clients = [f.result() for f in futures if f.exception() is None]
    try:
        assert len(clients) == 3, [f.exception() for f in futures]
        for client in clients:  # one at a time: killed, then shut down
            os.kill(client.engine_pid, signal.SIGKILL)
            t = time.monotonic()
            with caplog.at_level("WARNING", logger="treadle"):
                client.shutdown()
            assert time.monotonic() - t < 5
            assert not [r for r in caplog.records if "did not stop" in r.getMessage()]
    finally:
        for client in clients:
            client.shutdown()  # (a no-op for those already shut down)
