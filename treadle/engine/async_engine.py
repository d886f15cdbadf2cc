"""AsyncLLM: one LLMEngine stepped by a background thread of this process.

The in-process EngineClient (the Python async API, ``treadle serve
--engine-in-process``, in-process tests); ``EngineCoreClient`` runs the same loop in
its own process instead. The engine is not thread-safe, so every engine call happens
on the engine thread. Callers on the event loop send commands (add, abort) through a
queue; the thread applies them between steps and hands each RequestOutput back to the
event loop with ``call_soon_threadsafe``, into the asyncio queue of the
``OutputGroup`` that owns the request.

    event loop                       engine thread
    ----------                       -------------
    OutputGroup.add  --_Add-->       EngineCore.admit  (error -> future)
    OutputGroup.close --_Abort-->    EngineCore.abort (blocks freed)
    async for out in group  <--      EngineCore.step() outputs, per request
                            <--      StepFailedError, to the requests of a failed step

A step that fails with StepFailedError fails only its own requests (they receive the
error) and the loop goes on. Any other exception (EngineDeadError: a lost worker) marks
the engine dead: every open request receives an EngineDeadError (no client hangs), new
requests are refused, and the thread ends.
``heartbeat_age()`` lets a health check tell a dead or stuck loop from a busy one.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch

from treadle.config import EngineDeadError, TreadleError
from treadle.engine.args import EngineArgs
from treadle.engine.engine_client import EngineClient, Sink, post_by_loop
from treadle.engine.engine_core import EngineCore
from treadle.engine.llm_engine import LLMEngine, PromptType
from treadle.sampling_params import SamplingParams
from treadle.structured import StructuredOutputsParams

logger = logging.getLogger("treadle")

_IDLE_WAIT_S = 0.25  # how often an idle loop wakes to refresh its heartbeat


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    priority: int
    max_waiting: int | None
    arrival_time: float
    sink: Sink
    done: concurrent.futures.Future[None]


@dataclass
class _Abort:
    request_ids: list[str]


class _Done:
    """Nothing to wait for: awaiting it returns at once."""

    def __await__(self) -> Generator[None, None, None]:
        yield from ()


class AsyncLLM(EngineClient):
    def __init__(self, engine: LLMEngine, heartbeat_timeout: float = 60.0) -> None:
        self._core = EngineCore(engine)  # touched only by the engine thread after start
        self._compile_grammar = engine.compile_grammar  # thread-safe: the compiler's cache is locked
        self.tokenizer = engine.tokenizer
        self.model_config = engine.model_config
        self.max_model_len = engine.scheduler_config.max_model_len
        self.heartbeat_timeout = heartbeat_timeout
        self.dead_error: BaseException | None = None
        self.snapshot = self._core.snapshot()
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders "dead?" checks against the thread's final drain
        self._sinks: dict[str, Sink] = {}  # engine thread only
        self._stop = threading.Event()
        self._heartbeat = time.monotonic()
        self.num_open_requests = 0
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

    # -- event-loop side ------------------------------------------------------------
    async def admit(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int,
                    max_waiting: int | None, sink: Sink) -> None:
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._submit(_Add(request_id, prompt, params, priority, max_waiting, time.monotonic(), sink, done))
        await asyncio.wrap_future(done)

    def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """Into the cache the engine's add_request and an in-process runner read."""
        self._compile_grammar(spec)

    def abort(self, request_ids: list[str] | str) -> _Done:
        """Queue the abort for the engine thread; ``await engine.abort(rid)`` (vLLM's form)
        works as well as a plain call."""
        self._submit(_Abort([request_ids] if isinstance(request_ids, str) else list(request_ids)))
        return _Done()

    def is_alive(self) -> bool:
        return self.dead_error is None and self._thread.is_alive()

    def heartbeat_age(self) -> float:
        return time.monotonic() - self._heartbeat

    def health(self) -> str | None:
        problem = self._core.engine.health() if self.is_alive() else None  # an idle engine learns of a lost worker here
        return f"engine is dead: {problem}" if problem is not None else super().health()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout)
        self._core.engine.shutdown()

    def _submit(self, command: _Add | _Abort) -> None:
        with self._lock:
            if self.dead_error is not None and isinstance(command, _Add):
                raise EngineDeadError(f"the engine is not running ({self.dead_error})")
            self._commands.put(command)

    # -- engine thread ------------------------------------------------------------------
    def _run(self, threads: int) -> None:
        torch.set_num_threads(threads)
        error = EngineDeadError("the engine was shut down")
        try:
            while not self._stop.is_set():
                self._apply_commands(block=not self._core.has_work())
                if self._core.has_work() and not self._stop.is_set():
                    self._step()
                self.snapshot = self._core.snapshot()
                self._heartbeat = time.monotonic()
        except BaseException as e:  # noqa: BLE001 - any failure must release the clients
            logger.exception("engine step failed; failing all open requests")
            error = EngineDeadError(f"engine step failed: {e!r}")
        self._fail_everything(error)

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while command is not None:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            finals = self._core.abort(command.request_ids)
            # a generator still waiting (an abort from outside it) gets its final "abort" output
            post_by_loop([(self._sinks[out.request_id], out) for out in finals if out.request_id in self._sinks])
            for rid in command.request_ids:
                self._sinks.pop(rid, None)
            return
        try:
            self._core.admit(command.request_id, command.prompt, command.params, command.priority,
                             command.max_waiting, command.arrival_time)
        except TreadleError as e:
            command.done.set_exception(e)
            return
        self._sinks[command.request_id] = command.sink
        command.done.set_result(None)

    def _step(self) -> None:
        result = self._core.step()
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
        self.snapshot = self._core.snapshot()  # a caller that sees an output sees its step's gauges
        post_by_loop(items)  # one wake-up of each event loop per step

    def _fail_everything(self, error: EngineDeadError) -> None:
        with self._lock:
            self.dead_error = error
        post_by_loop([(sink, error) for sink in self._sinks.values()])
        self._sinks.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                command.done.set_exception(error)
