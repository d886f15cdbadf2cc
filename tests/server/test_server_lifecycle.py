"""Health when the step loop fails or stalls, and the SIGTERM drain (in a subprocess)."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from server_harness import StepControl, engine, metric_values, serve, wait_until

from treadle.loaders.resolve import resolve_model
from treadle.server.app import build_app
from treadle.server.lifecycle import DrainingServer

pytestmark = pytest.mark.server  # starts processes (servers, workers)

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


# each serve_subprocess's TMPDIR (where its engine client makes its ipc socket folder, which a
# SIGKILLed server cannot remove), by pid: kill_group removes it
_TMPDIRS: dict[int, str] = {}


def serve_subprocess(port: int, step_delay: float, *flags: str) -> subprocess.Popen:
    """`treadle serve stories260k` (engine process by default) with ``step_delay`` s before
    each step, in its own session (so a test can signal its whole process group) and with its
    own TMPDIR (removed by kill_group)."""
    tests_dir = os.path.dirname(os.path.dirname(__file__))  # tests/, where engine_hooks is
    cmd = [sys.executable, "-c", "import engine_hooks as h; h.serve_main()", str(step_delay),
           "serve", "stories260k", "--port", str(port), "--kv-cache-memory", "8MiB", "--log-level", "warning",
           *flags]
    path = os.pathsep.join([tests_dir, *filter(None, [os.environ.get("PYTHONPATH")])])
    tmpdir = tempfile.mkdtemp(prefix="treadle-test-")
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, "TMPDIR": tmpdir},
                            start_new_session=True)
    _TMPDIRS[proc.pid] = tmpdir
    return proc


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
    """SIGKILL the server and anything it started (the engine process), reap it, and remove
    its TMPDIR."""
    try:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)
    finally:
        tmpdir = _TMPDIRS.pop(proc.pid, None)
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)


def _health(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.TransportError:
        return None


def _stream_events(url: str, body: dict, events: list[str]) -> None:
    with httpx.stream("POST", url + CMPL, json={**body, "stream": True}, timeout=30) as resp:
        events.extend(sse_events(resp))


def test_drain_timeout_ends_every_request_with_an_error_then_exits():
    """In-process drain (the SIGTERM handler's path without the signal): new work is refused
    at once; at --shutdown-timeout each unfinished stream gets an OpenAI error event and
    [DONE], a non-streaming request a 503 body, and the server is gone within a second."""
    control = StepControl()
    control.set_step_delay(0.01)  # 450 tokens take seconds even on a quiet machine, so none finishes in time
    with engine(resolve_model("stories260k"), control=control, max_num_seqs=1) as llm:
        _drain_timeout(llm, timeout=1.0, body={**LONG, "max_tokens": 450})


def _drain_timeout(llm, timeout: float, body: dict) -> None:
    app = build_app(llm, "tiny")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = DrainingServer(uvicorn.Config(app, log_level="critical", timeout_graceful_shutdown=1, lifespan="off"),
                            app.state.treadle, shutdown_timeout=timeout)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    streams: list[list[str]] = [[] for _ in range(4)]
    plain: dict[str, httpx.Response] = {}
    clients = [threading.Thread(target=_stream_events, args=(url, body, events)) for events in streams]
    clients.append(threading.Thread(target=lambda: plain.setdefault("r", httpx.post(url + CMPL, json=body,
                                                                                    timeout=30))))
    try:
        wait_until(lambda: server.started, 30, "server start")
        for c in clients:  # one slot: one runs, four queue behind it, 450 tokens each: seconds of work
            c.start()
        wait_until(lambda: llm.num_open_requests == 5, 10, "all five in flight")
        started = time.monotonic()
        server.request_drain()
        late = httpx.post(url + CMPL, json={"prompt": "Once"}, timeout=5)  # new work: refused at once
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        thread.join(10)
        took = time.monotonic() - started
        assert took < timeout + 1.0 + 1.0, took  # timeout, plus a second (plus slack for a loaded machine)
        for c in clients:
            c.join(10)
        for events in streams:
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["code"] == "shutting_down"
        assert plain["r"].status_code == 503 and plain["r"].json()["error"]["code"] == "shutting_down"
        wait_until(lambda: llm.num_open_requests == 0 and llm.snapshot.num_running == 0, 5, "abort")
        assert llm.snapshot.num_free_blocks == llm.snapshot.num_blocks
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_second_sigterm_ends_streams_with_an_error_and_exits_at_once():
    """`treadle serve` prints where it is; on SIGTERM it drains; a second SIGTERM aborts what
    is left: every stream ends with an error event and [DONE], one log line sums it up, no
    tracebacks, and the process is gone within a second, exit code 0."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "treadle.entrypoints.cli", "serve", "stories260k", "--port", str(port),
           "--kv-cache-memory", "8MiB", "--max-num-seqs", "1", "--shutdown-timeout", "30", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    streams: list[list[str]] = [[] for _ in range(6)]
    clients = [threading.Thread(target=_stream_events, args=(url, {**LONG, "max_tokens": 400}, events), daemon=True)
               for events in streams]
    try:
        wait_until(lambda: proc.poll() is not None or _health(url) == 200, 120, "server start")
        assert proc.poll() is None, "the server exited at start-up"
        for c in clients:  # one slot: one runs, five queue
            c.start()
        wait_until(lambda: _open_requests(url) == 6, 10, "six requests in flight")
        assert "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text()  # the API process serves without torch
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: _health(url) == 503, 10, "draining")
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        for c in clients:
            c.join(10)
        answered = time.monotonic() - started  # every client has its error and [DONE]
        out, err = proc.communicate(timeout=10)
        exited = time.monotonic() - started
        assert answered < 1.5, answered  # no timeout left after a second signal: within a second (+ slack)
        assert exited < 5.0 and proc.returncode == 0, (exited, proc.returncode)  # + the interpreter's teardown
        for events in streams:
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "shutting_down"
        assert f"{url}/v1" in out and "curl " in out  # the start-up announcement
        assert "Traceback" not in err
        assert [line for line in err.splitlines() if "aborted" in line] == \
            ["WARNING treadle: shutdown: aborted 6 unfinished request(s) with a 503 error"]
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the server and its engine process
            proc.communicate()


def _open_requests(url: str) -> float:
    try:
        return metric_values(url)["treadle:num_requests_open"]
    except httpx.TransportError:
        return -1
