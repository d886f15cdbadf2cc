"""CoreLoop, the one step loop of both engine clients, over a real engine (stories260k),
driven through a transport written here: it hands the loop the batches of commands a test
lists and records, in order, everything the loop sends back. Also the in-process client's
utility calls (AsyncLLM runs the same loop on a thread; no process is started)."""
from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import pytest

from treadle import LLM, SamplingParams
from treadle.config import EngineDeadError, TreadleError
from treadle.engine.client.in_process import AsyncLLM
from treadle.engine.core.engine_core import EngineCore
from treadle.engine.core.loop import CoreLoop, CoreTransport
from treadle.engine.core.messages import (
    AbortRequests,
    AddRequest,
    EngineSnapshot,
    Shutdown,
    StepResult,
    ToCore,
    UtilityCall,
)
from treadle.engine.llm_engine import LLMEngine
from treadle.engine.outputs import RequestOutput
from treadle.structured import StructuredOutputsParams

KW: dict[str, Any] = dict(num_kv_blocks=64, block_size=16, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CHOICES = ["yes", "no", "maybe"]


class ScriptedTransport(CoreTransport):
    """Gives the loop one listed batch per iteration, then nothing (waiting as asked) until
    ``done()``, then Shutdown; ends the loop (None) after ``timeout`` s so a test never hangs."""

    def __init__(self, batches: list[list[ToCore]], done: Callable[[], bool] = lambda: True,
                 timeout: float = 30.0) -> None:
        self.batches, self.done = deque(batches), done
        self.deadline = time.monotonic() + timeout
        self.timed_out = False
        self.events: list[tuple[str, Any]] = []
        self.outputs: dict[str, RequestOutput] = {}  # each request's latest output
        self.snapshot: EngineSnapshot | None = None

    def receive(self, wait_s: float) -> list[ToCore] | None:
        if time.monotonic() > self.deadline:
            self.timed_out = True
            return None
        if self.batches:
            return self.batches.popleft()
        if self.done():
            return [Shutdown()]
        time.sleep(wait_s)
        return []

    def admitted(self, results: list[tuple[str, TreadleError | None]]) -> None:
        self.events += [("admitted", r) for r in results]

    def aborted(self, request_ids: list[str], finals: list[RequestOutput]) -> None:
        self.events.append(("aborted", request_ids))

    def report(self, result: StepResult, snapshot: EngineSnapshot) -> None:
        self.snapshot = snapshot
        for out in result.outputs:
            self.outputs[out.request_id] = out
            self.events.append(("output", out.request_id))
        if result.failed is not None:
            self.events.append(("failed", result.failed.request_ids))

    def answer(self, call_id: int, value: Any, error: BaseException | None) -> None:
        self.events.append(("answer", (call_id, value, error)))

    def dead(self, reason: str) -> None:
        self.events.append(("dead", reason))

    def finished(self, *request_ids: str) -> bool:
        return all(rid in self.outputs and self.outputs[rid].finished for rid in request_ids)


@pytest.fixture(scope="module")
def core():
    core = EngineCore(LLMEngine.from_args("stories260k", **KW))
    yield core
    core.shutdown()


def add(rid: str, prompt: Any, params: SamplingParams = GREEDY) -> AddRequest:
    return AddRequest(rid, prompt, params, 0, None, 0.0)


def run(core: EngineCore, transport: ScriptedTransport) -> ScriptedTransport:
    CoreLoop(core, transport).run()
    assert not transport.timed_out, f"the loop did not finish: {transport.events[-5:]}"
    return transport


def test_loop_admits_steps_answers_and_stops_on_shutdown(core: EngineCore) -> None:
    prompts = ["Once upon a time", [1, 400, 300]]
    t = ScriptedTransport([[add("a", prompts[0]), add("b", prompts[1]), UtilityCall(7, "ping"),
                            UtilityCall(8, "no_such_call")]], lambda: t.finished("a", "b"))
    run(core, t)
    assert [e for e in t.events if e[0] == "admitted"] == [("admitted", ("a", None)), ("admitted", ("b", None))]
    answers = {call_id: (value, error) for kind, (call_id, value, error) in
               (e for e in t.events if e[0] == "answer")}
    assert answers[7] == (os.getpid(), None)
    assert isinstance(answers[8][1], TreadleError) and "no_such_call" in str(answers[8][1])
    assert not any(kind in ("dead", "failed") for kind, _ in t.events)
    want = LLM("stories260k", **KW).generate(prompts, GREEDY, use_tqdm=False)
    assert [t.outputs[rid].outputs[0].token_ids for rid in "ab"] == [w.outputs[0].token_ids for w in want]
    assert t.snapshot is not None and t.snapshot.num_free_blocks == t.snapshot.num_blocks


def test_an_abort_behind_its_add_is_answered_after_the_admission(core: EngineCore) -> None:
    """A client that sees the admission before the abort can forget the request for good."""
    t = run(core, ScriptedTransport([[add("c", "Once upon a time"), AbortRequests(["c"])]]))
    assert t.events[:2] == [("admitted", ("c", None)), ("aborted", ["c"])]
    assert "c" not in t.outputs and not core.has_work()
    assert t.snapshot is not None and t.snapshot.num_free_blocks == t.snapshot.num_blocks


def test_a_structured_add_waits_for_its_grammar_off_the_loop(core: EngineCore) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=CHOICES))
    t = ScriptedTransport([[add("s", "Once upon a time", params), add("p", "The cat"),
                            add("gone", "The dog", params), AbortRequests(["gone"])]],
                          lambda: t.finished("s", "p") and any(r[0] == "gone" for k, r in t.events if k == "admitted"))
    run(core, t)
    admitted = [r for kind, r in t.events if kind == "admitted"]
    assert admitted[0] == ("p", None)  # the plain add did not wait for the compiles
    assert ("s", None) in admitted
    [(_, refused)] = [r for r in admitted if r[0] == "gone"]
    assert isinstance(refused, TreadleError) and "aborted while its grammar compiled" in str(refused)
    assert t.outputs["s"].outputs[0].text in CHOICES and "gone" not in t.outputs


def test_what_comes_after_shutdown_is_left_unapplied(core: EngineCore) -> None:
    t = run(core, ScriptedTransport([[Shutdown(), add("late", "Once upon a time")]]))
    assert [kind for kind, _ in t.events] == [] and not core.has_work()


def test_in_process_client_runs_utility_calls_on_its_loop() -> None:
    llm = AsyncLLM(LLMEngine.from_args("stories260k", **KW))
    try:
        assert asyncio.run(llm.call_utility("ping")) == os.getpid()
        assert asyncio.run(llm.call_utility("snapshot"))["num_blocks"] == KW["num_kv_blocks"]
        with pytest.raises(TreadleError, match="no utility call 'nope'"):
            asyncio.run(llm.call_utility("nope"))
    finally:
        llm.shutdown()
    with pytest.raises(EngineDeadError):
        asyncio.run(llm.call_utility("ping"))
