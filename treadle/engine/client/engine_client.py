"""EngineClient: what the server (and any asyncio caller) uses of an engine, wherever its
step loop runs: ``AsyncLLM`` (``in_process.py``: a thread of this process) or
``EngineCoreClient`` (``multi_process.py``: an engine-core process). Outputs reach
callers through ``OutputGroup``s: one asyncio queue per group, fed from the client's loop
or reader thread by ``post``.

    caller (event loop)                          client
    -------------------                          ------
    group.add(rid, prompt, params) --admit-->    queued in the engine (or TreadleError)
    async for out in group        <--post--      RequestOutputs of the group's requests
    group.close()                 --abort-->     unfinished requests aborted, blocks freed

A dead engine fails every open request with EngineDeadError and refuses new ones.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from treadle.config import EngineDeadError, ModelConfig
from treadle.engine.core.messages import EngineSnapshot
from treadle.engine.inputs import PromptType
from treadle.engine.outputs import RequestOutput
from treadle.predict.model import LengthPredictor
from treadle.sampling_params import SamplingParams, StructuredOutputsParams
from treadle.tokenizer import Tokenizer


@dataclass
class Sink:
    """Where a request's outputs go: an asyncio queue, fed on its own event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any]


def _put_all(items: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def post(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    """From any thread: put ``items`` on their queues, on the queues' event loop (one wake-up)."""
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:  # the event loop has closed: nobody is listening any more
        pass


def post_by_loop(items: list[tuple[Sink, Any]]) -> None:
    """Post each item to its sink, waking each event loop once."""
    batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], Any]]] = {}
    for sink, item in items:
        batches.setdefault(sink.loop, []).append((sink.queue, item))
    for loop, batch in batches.items():
        post(loop, batch)


def settle(future: concurrent.futures.Future[Any], value: Any, error: BaseException | None) -> None:
    """Resolve ``future`` with ``value``, or fail it with ``error``, unless it is already done."""
    if future.done():
        return
    if error is None:
        future.set_result(value)
    else:
        future.set_exception(error)


class EngineClient(ABC):
    """An engine serving asyncio callers. Attributes every client sets: ``tokenizer``,
    ``model_config``, ``max_model_len``, ``max_num_seqs``, ``length_predictor`` (the engine's, or
    None), ``heartbeat_timeout``; ``snapshot`` (the latest
    gauges), ``dead_error`` (None while alive) and ``num_open_requests`` (maintained by
    the OutputGroups: admitted and not yet finished or closed)."""

    tokenizer: Tokenizer | None  # None: skip_tokenizer_init (token ids in and out)
    model_config: ModelConfig
    max_model_len: int
    max_num_seqs: int
    length_predictor: LengthPredictor | None
    heartbeat_timeout: float
    snapshot: EngineSnapshot
    dead_error: BaseException | None
    num_open_requests: int

    @abstractmethod
    async def admit(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int,
                    max_waiting: int | None, sink: Sink) -> None:
        """Queue one request whose outputs (RequestOutput, or an exception that ends the
        request) go to ``sink``. Returns once the engine has taken it; raises the engine's
        TreadleError (too long, QueueFullError, EngineDeadError) if it has not. If the
        caller is cancelled meanwhile, the request may still land: abort it."""

    @abstractmethod
    def abort(self, request_ids: list[str] | str) -> Any:
        """Abort these requests (unknown or finished ids are ignored); their blocks are
        freed. Never blocks on the engine. (AsyncLLM: a ``generate`` still iterating one of
        them gets a last output with finish_reason "abort", and the call may be awaited, as
        vLLM's is.)"""

    @abstractmethod
    def is_alive(self) -> bool:
        """False once the step loop has stopped (failed, killed or shut down)."""

    @abstractmethod
    def heartbeat_age(self) -> float:
        """Seconds since the step loop last finished an iteration (a step or an idle wait)."""

    @abstractmethod
    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the step loop within about ``timeout`` seconds; open requests fail with
        EngineDeadError. Idempotent."""

    @abstractmethod
    def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compile a structured-output spec, or raise an InvalidRequestError naming its
        problem (also when there is no tokenizer). Blocking: the server calls it from its
        tokenizer worker thread, never the event loop, so a bad spec is a 400 there and
        the step loop finds a good one cached."""

    def group(self) -> OutputGroup:
        return OutputGroup(self)

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield a RequestOutput each step the request advances; the last has ``finished``.
        Leaving the loop early (or being cancelled) aborts the request."""
        group = self.group()
        try:
            await group.add(request_id, prompt, sampling_params, priority)
            async for out in group:
                yield out
        finally:
            group.close()

    def health(self) -> str | None:
        """None when the loop is alive and answering, else why not."""
        if not self.is_alive():
            return f"engine is dead: {self.dead_error!r}" if self.dead_error else "the engine has stopped"
        age = self.heartbeat_age()
        if age > self.heartbeat_timeout:
            return f"engine is stuck: no step completed for {age:.1f} s"
        return None


class OutputGroup:
    """Requests whose outputs arrive on one asyncio queue (one HTTP request with several
    prompts). Iterating yields outputs until every request has finished; ``close()``
    aborts the unfinished ones and must always be called (it is idempotent)."""

    def __init__(self, llm: EngineClient) -> None:
        self._llm = llm
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.unfinished: set[str] = set()

    async def add(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0,
                  max_waiting: int | None = None) -> None:
        """Admit one request; raises the engine's TreadleError (too long, queue full, dead)."""
        self._track(request_id)
        try:
            await self._llm.admit(request_id, prompt, params, priority, max_waiting,
                                  Sink(asyncio.get_running_loop(), self._queue))
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
