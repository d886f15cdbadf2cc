"""Health when the step loop fails or stalls, and the SIGTERM drain (in a subprocess)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest
import uvicorn
from server_harness import StepControl, engine, serve, wait_until

from treadle.loaders.resolve import resolve_model
from treadle.server import build_app
from treadle.server.lifecycle import DrainingServer

CMPL = "/v1/completions"
LONG = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}


def sse_events(resp: httpx.Response):
    for line in resp.iter_lines():
        if line.startswith("data: "):
            yield line[6:]


@pytest.mark.parametrize("in_process", [False, True], ids=["engine-process", "engine-thread"])
def test_failed_step_fails_requests_and_health(in_process):
    control = StepControl()
    with serve(resolve_model("stories260k"), control=control, in_process=in_process) as (srv, llm):
        url = srv.url
        control.set_step_delay(0.05)
        done: dict[str, httpx.Response] = {}
        blocking = threading.Thread(target=lambda: done.setdefault("r", httpx.post(url + CMPL, json=LONG, timeout=30)))
        with httpx.stream("POST", url + CMPL, json={**LONG, "stream": True}, timeout=30) as resp:
            events = sse_events(resp)
            assert json.loads(next(events))["choices"]
            blocking.start()
            wait_until(lambda: llm.snapshot.num_running == 2, 10, "both requests running in the engine")
            control.fail_next_step()
            rest = list(events)  # the stream ends instead of hanging
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["error"]["code"] == "engine_error"
        blocking.join(30)
        assert done["r"].status_code == 500 and done["r"].json()["error"]["code"] == "engine_error"
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and "dead" in health.json()["error"]["message"]
        refused = httpx.post(url + CMPL, json={"prompt": "Once", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"
        assert "retry-after" in refused.headers


def test_stuck_step_loop_turns_health_503_until_it_moves():
    control = StepControl()
    with serve(resolve_model("stories260k"), heartbeat_timeout=0.5, control=control) as (srv, _):
        url = srv.url
        assert httpx.get(url + "/health").status_code == 200
        control.set_step_delay(1.5)
        result: dict[str, httpx.Response] = {}
        worker = threading.Thread(target=lambda: result.setdefault(
            "r", httpx.post(url + CMPL, json={"prompt": "Once", "max_tokens": 3, "ignore_eos": True}, timeout=60)))
        worker.start()
        stuck = wait_until(lambda: httpx.get(url + "/health").status_code == 503, 10, "health to report stuck")
        assert stuck and "stuck" in httpx.get(url + "/health").json()["error"]["message"]
        control.set_step_delay(0)
        worker.join(60)
        assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] == 3
        wait_until(lambda: httpx.get(url + "/health").status_code == 200, 10, "health to recover")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_subprocess(port: int, step_delay: float, *flags: str) -> subprocess.Popen:
    """`treadle serve stories260k` (engine process by default) with ``step_delay`` s before
    each step, in its own session (so a test can signal its whole process group)."""
    tests_dir = os.path.dirname(__file__)
    cmd = [sys.executable, "-c", "import server_harness as h; h.serve_main()", str(step_delay),
           "serve", "stories260k", "--port", str(port), "--kv-cache-memory", "8MiB", "--log-level", "warning",
           *flags]
    path = os.pathsep.join([tests_dir, *filter(None, [os.environ.get("PYTHONPATH")])])
    return subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path},
                            start_new_session=True)


@pytest.mark.slow
def test_sigterm_drains_in_flight_then_exits_0():
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve_subprocess(port, 0.03, "--shutdown-timeout", "30")
    try:
        wait_until(lambda: proc.poll() is not None or _health(url) == 200, 120, "server start")
        assert proc.poll() is None, "the server exited at start-up"
        with httpx.stream("POST", url + CMPL, json={**LONG, "max_tokens": 40, "stream": True}, timeout=60) as resp:
            events = sse_events(resp)
            assert json.loads(next(events))["choices"][0]["finish_reason"] is None
            os.killpg(proc.pid, signal.SIGTERM)  # the whole group: the engine process ignores it and drains too
            wait_until(lambda: _health(url) == 503, 10, "draining")
            late = httpx.post(url + CMPL, json={"prompt": "Once", "max_tokens": 2}, timeout=10)
            assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
            assert late.headers["retry-after"]
            chunks = [json.loads(e) for e in events if e != "[DONE]"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert len(chunks) == 40 - 1  # every token after the first chunk arrived
        assert proc.wait(60) == 0
    finally:
        kill_group(proc)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the server and anything it started (the engine process), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def _health(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.TransportError:
        return None


def test_drain_timeout_cuts_unfinished_requests_and_frees_them():
    """In-process drain (the SIGTERM handler's path without the signal): new work is refused
    at once; a request still running at --shutdown-timeout is aborted and the server stops."""
    control = StepControl()
    with engine(resolve_model("stories260k"), control=control) as llm:
        _drain_timeout(llm, control)


def _drain_timeout(llm, control: StepControl) -> None:
    app = build_app(llm, "tiny")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = DrainingServer(uvicorn.Config(app, log_level="critical", timeout_graceful_shutdown=1, lifespan="off"),
                            app.state.treadle, shutdown_timeout=0.5)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, 30, "server start")
        control.set_step_delay(0.05)
        with pytest.raises(httpx.RemoteProtocolError):  # the stream is cut, not completed
            with httpx.stream("POST", url + CMPL, json={**LONG, "stream": True}, timeout=30) as resp:
                events = sse_events(resp)
                assert json.loads(next(events))["choices"]
                server.request_drain()
                wait_until(lambda: _health(url) == 503, 5, "draining")
                assert httpx.post(url + CMPL, json={"prompt": "Once"}).status_code == 503
                list(events)
        thread.join(20)
        assert not thread.is_alive()
        wait_until(lambda: llm.num_open_requests == 0 and llm.snapshot.num_running == 0, 5, "abort")
        assert llm.snapshot.num_free_blocks == llm.snapshot.num_blocks
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
