"""AsyncLLM: the in-process EngineClient: the step loop (``core/loop.py``) on a background
thread of this process, with a transport of queues.

The Python async API, ``treadle serve --engine-in-process`` and in-process tests use it;
``EngineCoreClient`` (``multi_process.py``) runs the same loop in an engine-core process
instead. The engine is not thread-safe, so every engine call happens on the loop's
thread. Callers put the loop's commands (the ``ToCore`` messages, unencoded) on a queue;
the loop applies them between steps, and ``InProcessTransport`` hands each answer and
RequestOutput back with ``call_soon_threadsafe``, into the asyncio queue of the
``OutputGroup`` that owns the request.

    event loop                          engine thread (CoreLoop)
    ----------                          ------------------------
    OutputGroup.add   --AddRequest-->     EngineCore.admit  -> admitted: the add's future
    OutputGroup.close --AbortRequests-->  EngineCore.abort  -> aborted: finals to a waiting generator
    async for out in group      <--       report: the step's outputs, per request, or the
                                                  StepFailedError of a failed step (its requests only)
                                <--       dead: EngineDeadError to every open request

``heartbeat_age()`` lets a health check tell a dead or stuck loop from a busy one.
"""
from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import Generator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from treadle.config import EngineDeadError, TreadleError
from treadle.engine.args import EngineArgs
from treadle.engine.client.engine_client import EngineClient, Sink, post_by_loop, settle
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
from treadle.engine.inputs import PromptType
from treadle.engine.llm_engine import LLMEngine
from treadle.engine.outputs import RequestOutput
from treadle.sampling_params import SamplingParams
from treadle.structured import StructuredOutputsParams


@dataclass
class _Add:
    msg: AddRequest
    sink: Sink
    done: Future[None]


class InProcessTransport(CoreTransport):
    """Commands from any thread on one queue; answers and outputs straight into the callers'
    asyncio queues. Sets its client's ``snapshot`` and ``dead_error``."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.heartbeat = time.monotonic()
        self._commands: queue.SimpleQueue[ToCore] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards the two tables below; orders "dead?" checks against the final drain
        self._adding: dict[str, _Add] = {}  # sent, not yet answered
        self._calls: dict[int, Future[Any]] = {}
        self._sinks: dict[str, Sink] = {}  # admitted requests; the loop's thread only

    # -- callers' side -------------------------------------------------------------------
    def add(self, add: _Add) -> None:
        with self._lock:
            self._check_alive()
            if add.msg.request_id in self._adding:
                raise TreadleError(f"request id {add.msg.request_id!r} is already in use")
            self._adding[add.msg.request_id] = add
            self._commands.put(add.msg)

    def call(self, call: UtilityCall, done: Future[Any]) -> None:
        with self._lock:
            self._check_alive()
            self._calls[call.call_id] = done
            self._commands.put(call)

    def send(self, msg: AbortRequests | Shutdown) -> None:
        self._commands.put(msg)  # to a dead loop: nobody reads it, and there is nothing to undo

    def _check_alive(self) -> None:
        if self.client.dead_error is not None:
            raise EngineDeadError(f"the engine is not running ({self.client.dead_error})")

    # -- the loop's side -----------------------------------------------------------------
    def receive(self, wait_s: float) -> list[ToCore] | None:
        try:
            command = self._commands.get(timeout=wait_s) if wait_s > 0 else self._commands.get_nowait()
        except queue.Empty:
            return []
        commands = [command]
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def admitted(self, results: list[tuple[str, TreadleError | None]]) -> None:
        with self._lock:
            answers = [(add, error) for rid, error in results if (add := self._adding.pop(rid, None)) is not None]
        for add, error in answers:
            if error is None:
                self._sinks[add.msg.request_id] = add.sink
            settle(add.done, None, error)

    def aborted(self, request_ids: list[str], finals: list[RequestOutput]) -> None:
        # a generator still waiting (an abort from outside it) gets its final "abort" output
        post_by_loop([(self._sinks[out.request_id], out) for out in finals if out.request_id in self._sinks])
        for rid in request_ids:
            self._sinks.pop(rid, None)

    def report(self, result: StepResult, snapshot: EngineSnapshot) -> None:
        items: list[tuple[Sink, Any]] = []
        if result.failed is not None:  # only that step's requests fail; the loop goes on
            items += [(sink, result.failed) for rid in result.failed.request_ids
                      if (sink := self._sinks.pop(rid, None)) is not None]
        for out in result.outputs:
            sink = self._sinks.get(out.request_id)
            if sink is not None:
                items.append((sink, out))
                if out.finished:
                    del self._sinks[out.request_id]
        self.client.snapshot, self.heartbeat = snapshot, time.monotonic()  # before the outputs
        post_by_loop(items)  # one wake-up of each event loop per step

    def answer(self, call_id: int, value: Any, error: BaseException | None) -> None:
        with self._lock:
            done = self._calls.pop(call_id, None)
        if done is not None:
            settle(done, value, error)

    def dead(self, reason: str) -> None:
        self.fail_everything(EngineDeadError(reason))

    def fail_everything(self, error: EngineDeadError) -> None:
        """The loop has ended: every open request and waiting caller gets ``error`` (the
        first such error stays the client's ``dead_error``); later adds are refused."""
        with self._lock:
            if self.client.dead_error is None:
                self.client.dead_error = error
            waiting = [*(add.done for add in self._adding.values()), *self._calls.values()]
            self._adding, self._calls = {}, {}
        post_by_loop([(sink, error) for sink in self._sinks.values()])
        self._sinks.clear()
        for done in waiting:
            settle(done, None, error)


class _Done:
    """Nothing to wait for: awaiting it returns at once."""

    def __await__(self) -> Generator[None, None, None]:
        yield from ()


class AsyncLLM(EngineClient):
    def __init__(self, engine: LLMEngine, heartbeat_timeout: float = 60.0) -> None:
        self._core = EngineCore(engine)  # touched only by the loop's thread after start
        self._compile_grammar = engine.compile_grammar  # thread-safe: the compiler's cache is locked
        self.tokenizer = engine.tokenizer
        self.model_config = engine.model_config
        self.max_model_len = engine.scheduler_config.max_model_len
        self.max_num_seqs = engine.scheduler_config.max_num_seqs
        self.length_predictor = engine.length_predictor
        self.heartbeat_timeout = heartbeat_timeout
        self.dead_error: BaseException | None = None
        self.snapshot = self._core.snapshot()
        self.num_open_requests = 0
        self._transport = InProcessTransport(self)
        self._call_ids = itertools.count()
        threads = torch.get_num_threads()  # the C kernels read OpenMP's per-thread count: carry it over
        self._thread = threading.Thread(target=self._run, args=(threads,), name="treadle-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_args(cls, model: str | None = None, heartbeat_timeout: float = 60.0, **engine_kwargs: Any) -> AsyncLLM:
        """``engine_kwargs``: EngineArgs fields; unset ones take EngineArgs' defaults."""
        return cls(LLMEngine.from_args(model, **engine_kwargs), heartbeat_timeout)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, heartbeat_timeout: float = 60.0) -> AsyncLLM:
        """vLLM's spelling: ``AsyncLLM.from_engine_args(EngineArgs(model=...))``."""
        return cls(LLMEngine.from_engine_args(args), heartbeat_timeout)

    async def admit(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int,
                    max_waiting: int | None, sink: Sink) -> None:
        add = _Add(AddRequest(request_id, prompt, params, priority, max_waiting, time.monotonic()), sink, Future())
        self._transport.add(add)
        await asyncio.wrap_future(add.done)

    def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """Into the cache the engine's add_request and an in-process runner read."""
        self._compile_grammar(spec)

    def abort(self, request_ids: list[str] | str) -> _Done:
        """Queue the abort for the loop; ``await engine.abort(rid)`` (vLLM's form) works as
        well as a plain call."""
        self._transport.send(AbortRequests([request_ids] if isinstance(request_ids, str) else list(request_ids)))
        return _Done()

    async def call_utility(self, method: str, *args: Any, timeout: float = 30.0) -> Any:
        """Run ``core.loop.UTILITIES[method](core, *args)`` on the loop's thread, between steps."""
        done: Future[Any] = Future()
        self._transport.call(UtilityCall(next(self._call_ids), method, list(args)), done)
        return await asyncio.wait_for(asyncio.wrap_future(done), timeout)

    def is_alive(self) -> bool:
        return self.dead_error is None and self._thread.is_alive()

    def heartbeat_age(self) -> float:
        return time.monotonic() - self._transport.heartbeat

    def health(self) -> str | None:
        problem = self._core.health() if self.is_alive() else None  # at once, before the idle loop sees it
        return f"engine is dead: {problem}" if problem is not None else super().health()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._transport.send(Shutdown())
        self._thread.join(timeout)
        self._core.shutdown()

    def _run(self, threads: int) -> None:
        torch.set_num_threads(threads)
        try:
            CoreLoop(self._core, self._transport).run()
        finally:
            self._transport.fail_everything(EngineDeadError("the engine was shut down"))
