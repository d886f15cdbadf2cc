"""Issue 34: with the ``mp`` (or ``ray``) executor the worker processes compile a structured-output grammar
when it is announced (LLMEngine.compile_grammar -> Executor.prepare_grammar), in a
thread beside their step loop, so the step that adds the request finds it compiled. Before,
the worker compiled it inside that step: every running request stalled for the whole compile."""
from __future__ import annotations

import json
import threading
import time

import pytest
from server_harness import ENGINE_KW

from treadle import LLM, SamplingParams, StructuredOutputsParams
from treadle.config import EngineDeadError, InvalidRequestError

pytestmark = [pytest.mark.server, pytest.mark.slow]  # starts a worker process; seconds of compile


def slow_spec(properties: int) -> StructuredOutputsParams:
    """Optional properties: xgrammar's compile time grows steeply with them (stories260k:
    ~0.5 s at 600, several seconds at 1,000 on this loaded 2-core machine)."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(properties)}}
    return StructuredOutputsParams(json=json.dumps(schema))


@pytest.mark.parametrize("executor", ["mp", "ray"])
def test_workers_compile_a_grammar_ahead_and_no_step_stalls(executor: str) -> None:
    llm = LLM("stories260k", distributed_executor_backend=executor, **ENGINE_KW)
    engine = llm.engine
    try:
        with pytest.raises(InvalidRequestError, match="invalid regex"):
            engine.compile_grammar(StructuredOutputsParams(regex="(a"))  # the workers' verdict
        engine.add_request("free", "Once upon a time", SamplingParams(max_tokens=400, ignore_eos=True))
        spec = slow_spec(1000)
        compiled = threading.Event()
        took: list[float] = []

        def announce() -> None:
            t0 = time.monotonic()
            engine.compile_grammar(spec)
            took.append(time.monotonic() - t0)
            compiled.set()

        threading.Thread(target=announce, daemon=True).start()
        steps: list[float] = []
        added, first_token = False, False
        deadline = time.monotonic() + 300
        while not first_token and time.monotonic() < deadline:
            if compiled.is_set() and not added:
                engine.add_request("json", "Once", SamplingParams(max_tokens=8, structured_outputs=spec))
                added = True
            t0 = time.monotonic()
            outs = engine.step()
            steps.append(time.monotonic() - t0)
            first_token = any(o.request_id == "json" and o.outputs[0].token_ids for o in outs)
            time.sleep(0.01)
        assert first_token, "the structured request produced no token"
        assert took[0] > 1.0, f"the compile took {took[0]:.2f} s: too short to show a stall"
        assert max(steps) < 1.0, f"a step took {max(steps):.2f} s while the grammar ({took[0]:.1f} s) compiled"
    finally:
        engine.shutdown()


def test_shutdown_while_the_workers_compile_ends_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """A grammar still compiling in the workers does not hold the engine's shutdown: the wait
    for their answers ends with EngineDeadError and the workers are stopped (killed after the
    grace period when a compile of minutes holds them)."""
    monkeypatch.setenv("TREADLE_WORKER_STOP_GRACE_S", "1")  # not the default 5 s: the kill comes sooner
    llm = LLM("stories260k", distributed_executor_backend="mp", **ENGINE_KW)
    engine = llm.engine
    errors: list[BaseException] = []

    def announce() -> None:
        try:
            engine.compile_grammar(slow_spec(2000))  # tens of seconds
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    waiter = threading.Thread(target=announce, daemon=True)
    waiter.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    engine.shutdown()
    took = time.monotonic() - t0
    waiter.join(10)
    assert not waiter.is_alive(), "the wait for the workers' compile outlived the shutdown"
    assert errors and isinstance(errors[0], EngineDeadError), errors
    assert took < 15.0, f"shutdown took {took:.1f} s"
