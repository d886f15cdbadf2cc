"""Issue 34, fault 1: a structured-output schema must not freeze the server. A spec is compiled
first in a child process under --max-grammar-compile-s / --max-grammar-bytes (over either: a
400 naming the flag), once per spec; the engine compiles it beside its step loop, so other
streams keep receiving tokens; SIGTERM during a compile stops the server at once."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from server_harness import StepControl, serve, wait_until
from test_server_lifecycle import _free_port, _health, kill_group, serve_subprocess, sse_events  # tests/server

from treadle import LLM
from treadle.config import InvalidRequestError
from treadle.loaders.resolve import resolve_model
from treadle.sampling_params import StructuredOutputsParams
from treadle.server.state import ServerLimits
from treadle.structured.compiler import GrammarCompiler, tokenizer_info
from treadle.structured.probe import CompileProbe

CMPL = "/v1/completions"


def schema(properties: int) -> dict:
    """An object of ``properties`` optional string properties: xgrammar's compile time grows
    steeply with them (stories260k's vocabulary: 0.2 s at 300, 1.5 s at 600, 7.6 s at 1,000)."""
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(properties)}}


def spec(properties: int) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=json.dumps(schema(properties)))


def structured(properties: int, **extra) -> dict:
    return {"prompt": "Once", "max_tokens": 4, "guided_json": schema(properties), **extra}


def test_probe_refuses_slow_and_large_specs_and_compiles_each_spec_once() -> None:
    engine = LLM("stories260k").engine
    cfg = engine.model_config
    info = tokenizer_info(engine.tokenizer, cfg.vocab_size, cfg.stop_token_ids)
    probe = CompileProbe(info.serialize_json(), max_seconds=0.5, max_bytes=40_000, direct_chars=0)  # all to the child
    try:
        probe.check(spec(5))  # starts the child (not charged to the budget)
        probe.check(spec(5))
        assert probe.compiles == 1  # a spec that passed is remembered
        t0 = time.monotonic()
        with pytest.raises(InvalidRequestError, match="--max-grammar-compile-s"):
            probe.check(spec(1400))  # ~39 KB, tens of seconds to compile
        assert time.monotonic() - t0 < 3.0
        assert probe.compiles == 2
        with pytest.raises(InvalidRequestError, match="--max-grammar-bytes"):
            probe.check(spec(2000))  # ~56 KB
        assert probe.compiles == 2  # refused by its size, never compiled
        with pytest.raises(InvalidRequestError, match='invalid JSON schema for structured output: Unsupported type'):
            probe.check(StructuredOutputsParams(json='{"type": "nope"}'))  # found by the grammar build, not compiled
        probe.check(spec(6))  # a fresh child, started after the kill
        assert probe.compiles == 3
    finally:
        probe.close()


def test_a_small_spec_is_compiled_once_by_the_engine_and_only_a_large_one_in_the_probe() -> None:
    """The server's path for a spec: CompileProbe.check, then the engine's GrammarCompiler.
    A small spec (a grammar of few characters and counted repetitions: under a second) skips
    the probe's child, so it is compiled once; before, every spec was compiled twice."""
    engine = LLM("stories260k").engine
    cfg = engine.model_config
    compiler = GrammarCompiler(engine.tokenizer, cfg.vocab_size, cfg.stop_token_ids)
    probe = CompileProbe(tokenizer_info(engine.tokenizer, cfg.vocab_size, cfg.stop_token_ids).serialize_json(),
                         max_seconds=60.0, max_bytes=40_000)
    small = [spec(5), StructuredOutputsParams(regex="[a-z]{1,8}"), StructuredOutputsParams(choice=["yes", "no"]),
             StructuredOutputsParams(grammar='root ::= "a" | "b"')]
    try:
        for s in small:
            probe.check(s)
            compiler.compile(s)
        assert (probe.compiles, compiler.compiles) == (0, len(small))  # once each, in the engine
        with pytest.raises(InvalidRequestError, match="invalid JSON schema for structured output: Unsupported type"):
            probe.check(StructuredOutputsParams(json='{"type": "nope"}'))  # found by the grammar build
        with pytest.raises(InvalidRequestError, match="invalid regex"):
            probe.check(StructuredOutputsParams(regex="(a"))
        assert probe.compiles == 0
        large = spec(200)  # ~27,000 grammar characters: the child compiles it under the budget
        probe.check(large)
        probe.check(large)  # remembered
        assert probe.compiles == 1
        probe.check(StructuredOutputsParams(regex='[^"]{0,64}'))  # 48 grammar characters, 1.3 s (SmolLM2):
        assert probe.compiles == 2  # counted repetitions compile like copies, so it goes to the child
    finally:
        probe.close()


def _stream(url: str, times: list[float], errors: list[BaseException], stop: threading.Event) -> None:
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + CMPL, json=body, timeout=60) as resp:
            for _ in sse_events(resp):
                times.append(time.monotonic())
                if stop.is_set():
                    return
    except BaseException as e:  # noqa: BLE001 - reported by the test
        errors.append(e)


@pytest.mark.server
@pytest.mark.slow
def test_slow_schema_is_refused_and_a_fair_one_compiles_while_another_stream_flows() -> None:
    limits = ServerLimits(max_grammar_compile_s=10.0)
    with serve(resolve_model("stories260k"), control=StepControl(step_delay=0.05), limits=limits) as (srv, _):
        url = srv.url
        warm = httpx.post(url + CMPL, json=structured(200), timeout=180)  # large enough for the probe: starts its child
        assert warm.status_code == 200, warm.text
        times: list[float] = []
        errors: list[BaseException] = []
        stop = threading.Event()
        streamer = threading.Thread(target=_stream, args=(url, times, errors, stop), daemon=True)
        streamer.start()
        wait_until(lambda: len(times) >= 3 or errors, 60, "the stream's first tokens")
        t0 = time.monotonic()
        slow = httpx.post(url + CMPL, json=structured(2000), timeout=60)  # ~56 KB; minutes to compile
        refused_after = time.monotonic() - t0
        assert slow.status_code == 400, slow.text
        error = slow.json()["error"]
        assert "--max-grammar-compile-s" in error["message"] and error["param"] == "guided_json"
        assert refused_after < 10.0 + 4.0
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        # 700 properties: ~2.5 s to compile in the probe, again in the engine process (beside its step loop)
        fair = httpx.post(url + CMPL, json=structured(700), timeout=60)
        assert fair.status_code == 200, fair.text
        assert streamer.is_alive(), "the stream ended before the compiles: nothing was shown"
        big = httpx.post(url + CMPL, json=structured(2500), timeout=60)  # ~70 KB
        assert big.status_code == 400 and "--max-grammar-bytes" in big.json()["error"]["message"]
        stop.set()
        streamer.join(60)
        assert not errors and len(times) >= 20
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        assert max(gaps) < 1.0, f"the stream stalled {max(gaps):.2f} s"


@pytest.mark.server
@pytest.mark.slow
def test_a_client_that_leaves_or_sigterm_stops_a_compile_at_once() -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve_subprocess(port, 0.0, "--max-grammar-compile-s", "600", "--max-grammar-bytes", "200000",
                            "--shutdown-timeout", "30")
    try:
        wait_until(lambda: proc.poll() is not None or _health(url) == 200, 120, "server start")
        warm = httpx.post(url + CMPL, json=structured(200), timeout=180)  # starts the probe's child
        assert warm.status_code == 200, warm.text
        with pytest.raises(httpx.ReadTimeout):  # 3,000 properties: minutes to compile; the client leaves
            httpx.post(url + CMPL, json=structured(3000), timeout=httpx.Timeout(60, read=1.5))
        t0 = time.monotonic()
        after = httpx.post(url + CMPL, json=structured(201), timeout=120)  # not queued behind the abandoned compile
        assert after.status_code == 200, after.text
        assert time.monotonic() - t0 < 45.0  # a fresh compile child's start-up at most (seconds on a loaded CPU)
        answers: list[int] = []
        sender = threading.Thread(target=lambda: answers.append(
            httpx.post(url + CMPL, json=structured(3000), timeout=60).status_code), daemon=True)
        sender.start()
        time.sleep(2.0)  # well into a compile of minutes
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(30) == 0
        assert time.monotonic() - t0 < 10.0
        sender.join(10)
        assert answers and answers[0] in (400, 503)
    finally:
        kill_group(proc)


