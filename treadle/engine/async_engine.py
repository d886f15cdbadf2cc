"""AsyncLLM: one LLMEngine stepped by a background thread, fed by asyncio callers.

The engine is not thread-safe, so every engine call happens on the engine thread.
Callers on the event loop send commands (add, abort, test hooks) through a queue;
the thread applies them between steps and hands each RequestOutput back to the
event loop with ``call_soon_threadsafe``, into the asyncio queue of the
``OutputGroup`` that owns the request.

    event loop                       engine thread
    ----------                       -------------
    OutputGroup.add  --_Add-->       engine.add_request  (error -> future)
    OutputGroup.close --_Abort-->    engine.abort_request (blocks freed)
    async for out in group  <--      engine.step() outputs, per request

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
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import torch

from treadle.config import EngineDeadError, TreadleError
from treadle.engine.llm_engine import LLMEngine, PromptType, StepFailedError
from treadle.engine.outputs import RequestOutput
from treadle.sampling_params import SamplingParams
from treadle.structured import StructuredOutputsParams

logger = logging.getLogger("treadle")

_IDLE_WAIT_S = 0.25  # how often an idle loop wakes to refresh its heartbeat


class QueueFullError(TreadleError):
    """More requests are waiting than the caller allowed (backpressure)."""


class InjectedStepFault(RuntimeError):
    """Raised inside the step loop by the ``fail_next_step`` test hook."""


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine gauges, refreshed by the engine thread on every loop iteration."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    num_blocks: int = 0
    num_preemptions: int = 0
    num_steps: int = 0


@dataclass
class _Sink:
    """Where a request's outputs go: an asyncio queue, fed on its own event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any]


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    priority: int
    max_waiting: int | None
    arrival_time: float
    sink: _Sink
    done: concurrent.futures.Future[None]


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Hook:
    """Test hooks: a delay before every step, or a fault raised in the next one."""

    step_delay: float | None = None
    fail_next_step: bool = False


class AsyncLLM:
    def __init__(self, engine: LLMEngine, heartbeat_timeout: float = 60.0) -> None:
        self._engine = engine  # touched only by the engine thread after start
        self.tokenizer = engine.tokenizer
        self.model_config = engine.model_config
        self.max_model_len = engine.scheduler_config.max_model_len
        self.heartbeat_timeout = heartbeat_timeout
        self.dead_error: BaseException | None = None
        self.snapshot = EngineSnapshot()
        self._commands: queue.SimpleQueue[_Add | _Abort | _Hook | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders "dead?" checks against the thread's final drain
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._stop = threading.Event()
        self._step_delay = 0.0
        self._fail_next = False
        self._heartbeat = time.monotonic()
        self.num_open_requests = 0  # event-loop side: added and not yet finished or closed
        self._snapshot_now()
        threads = torch.get_num_threads()  # the C kernels read OpenMP's per-thread count: carry it over
        self._thread = threading.Thread(target=self._run, args=(threads,), name="treadle-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_args(cls, model: str | None = None, heartbeat_timeout: float = 60.0, **engine_kwargs: Any) -> AsyncLLM:
        """``engine_kwargs``: EngineArgs fields; unset ones take EngineArgs' defaults."""
        return cls(LLMEngine.from_args(model, **engine_kwargs), heartbeat_timeout)

    # -- event-loop side ------------------------------------------------------------
    def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compile a structured-output spec into the cache the engine's add_request and an
        in-process runner read (thread-safe; call it from a worker thread, never the event
        loop). An invalid spec is an InvalidRequestError naming the problem."""
        self._engine.compile_grammar(spec)

    def group(self) -> OutputGroup:
        return OutputGroup(self)

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield a RequestOutput each step the request advances; the last has ``finished``.
        Leaving the loop early (or being cancelled) aborts the request."""
        group = self.group()
        try:
            await group.add(request_id, prompt, params, priority)
            async for out in group:
                yield out
        finally:
            group.close()

    def abort(self, request_ids: list[str] | str) -> None:
        self._submit(_Abort([request_ids] if isinstance(request_ids, str) else list(request_ids)))

    def set_step_delay(self, seconds: float) -> None:
        """Test hook: sleep this long before every step (a slow or stuck engine)."""
        self._submit(_Hook(step_delay=seconds))

    def fail_next_step(self) -> None:
        """Test hook: the next step raises InjectedStepFault, exercising the same path as
        an exception from the model or scheduler (requests fail, engine marked dead)."""
        self._submit(_Hook(fail_next_step=True))

    def is_alive(self) -> bool:
        return self.dead_error is None and self._thread.is_alive()

    def heartbeat_age(self) -> float:
        """Seconds since the loop last finished an iteration (a step, or an idle wait)."""
        return time.monotonic() - self._heartbeat

    def health(self) -> str | None:
        """None when the loop is alive and answering and the workers are alive, else why not."""
        if not self.is_alive():
            return f"engine is dead: {self.dead_error!r}" if self.dead_error else "engine thread has stopped"
        workers = self._engine.health()  # an idle engine learns of a lost worker here
        if workers is not None:
            return f"engine is dead: {workers}"
        age = self.heartbeat_age()
        if age > self.heartbeat_timeout:
            return f"engine is stuck: no step completed for {age:.1f} s"
        return None

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout)
        self._engine.shutdown()

    def _submit(self, command: _Add | _Abort | _Hook) -> None:
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
                self._apply_commands(block=not self._engine.has_unfinished_requests())
                if self._engine.has_unfinished_requests() and not self._stop.is_set():
                    self._step()
                self._snapshot_now()
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

    def _apply(self, command: _Add | _Abort | _Hook) -> None:
        if isinstance(command, _Add):
            self._apply_add(command)
        elif isinstance(command, _Abort):
            self._engine.abort_request(command.request_ids)
            for rid in command.request_ids:
                self._sinks.pop(rid, None)
        else:
            if command.step_delay is not None:
                self._step_delay = command.step_delay
            self._fail_next = self._fail_next or command.fail_next_step

    def _apply_add(self, cmd: _Add) -> None:
        try:
            waiting = self._engine.scheduler.num_waiting  # sequences, not requests
            if cmd.max_waiting is not None and waiting and waiting + cmd.params.n > cmd.max_waiting:
                raise QueueFullError(f"{waiting} sequences are already waiting (limit {cmd.max_waiting})")
            self._engine.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.priority, cmd.arrival_time)
        except TreadleError as e:
            cmd.done.set_exception(e)
            return
        except Exception as e:  # noqa: BLE001 - a request the engine cannot take must not stop the loop
            logger.exception("add_request failed for %s", cmd.request_id)
            self._engine.abort_request(cmd.request_id)
            cmd.done.set_exception(TreadleError(f"the engine could not admit the request: {e}"))
            return
        self._sinks[cmd.request_id] = cmd.sink
        cmd.done.set_result(None)

    def _step(self) -> None:
        if self._step_delay > 0:
            time.sleep(self._step_delay)
        if self._fail_next:
            self._fail_next = False
            raise InjectedStepFault("step failure injected by the fail_next_step test hook")
        try:
            outputs = self._engine.step()
        except StepFailedError as e:  # only that step's requests fail; the loop goes on
            for rid in e.request_ids:
                sink = self._sinks.pop(rid, None)
                if sink is not None:
                    _post(sink.loop, [(sink.queue, e)])
            return
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], Any]]] = {}
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is not None:
                batches.setdefault(sink.loop, []).append((sink.queue, out))
                if out.finished:
                    del self._sinks[out.request_id]
        for loop, items in batches.items():  # one wake-up of each event loop per step
            _post(loop, items)

    def _snapshot_now(self) -> None:
        eng = self._engine
        kv = eng.kv_manager
        self.snapshot = EngineSnapshot(
            num_running=eng.scheduler.num_running, num_waiting=eng.scheduler.num_waiting,
            kv_usage=kv.usage(), num_free_blocks=kv.num_free_blocks, num_blocks=kv.pool.num_blocks,
            num_preemptions=eng.stats.num_preemptions, num_steps=eng.stats.num_steps,
        )

    def _fail_everything(self, error: EngineDeadError) -> None:
        with self._lock:
            self.dead_error = error
        for sink in self._sinks.values():
            _post(sink.loop, [(sink.queue, error)])
        self._sinks.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                command.done.set_exception(error)


def _put_all(items: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def _post(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    """From the engine thread: put ``items`` on their queues, on the queues' event loop."""
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:  # the event loop has closed: nobody is listening any more
        pass


class OutputGroup:
    """Requests whose outputs arrive on one asyncio queue (one HTTP request with several
    prompts). Iterating yields outputs until every request has finished; ``close()``
    aborts the unfinished ones and must always be called (it is idempotent)."""

    def __init__(self, llm: AsyncLLM) -> None:
        self._llm = llm
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.unfinished: set[str] = set()

    async def add(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0,
                  max_waiting: int | None = None) -> None:
        """Admit one request; raises the engine's TreadleError (too long, queue full, dead)."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        sink = _Sink(asyncio.get_running_loop(), self._queue)
        cmd = _Add(request_id, prompt, params, priority, max_waiting, time.monotonic(), sink, done)
        self._llm._submit(cmd)
        self._track(request_id)
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            self.close()  # the add may still land: the abort queued behind it undoes it
            raise
        except BaseException:
            self._untrack(request_id)
            raise

    def _track(self, request_id: str) -> None:
        self.unfinished.add(request_id)
        self._llm.num_open_requests += 1

    def _untrack(self, request_id: str) -> None:
        if request_id in self.unfinished:
            self.unfinished.discard(request_id)
            self._llm.num_open_requests -= 1

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        while self.unfinished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.close()
                raise item
            if item.finished:
                self._untrack(item.request_id)
            yield item

    def fail(self, error: BaseException) -> None:
        """Make the iterator raise ``error`` (after what is already queued); it then closes."""
        self._queue.put_nowait(error)

    def close(self) -> None:
        if self.unfinished:
            ids = sorted(self.unfinished)
            for rid in ids:
                self._untrack(rid)
            try:
                self._llm.abort(ids)
            except EngineDeadError:
                pass
