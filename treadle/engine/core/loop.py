"""CoreLoop: the one step loop of every engine client, and the transport it talks through.

The loop owns an ``EngineCore``. A ``CoreTransport`` brings it the clients' commands (the
``ToCore`` messages of ``messages.py``) and carries what it produced back. The in-process
client (``client/in_process.py``: AsyncLLM) runs the loop on a thread with a transport of
queues; the multi-process client (``client/multi_process.py``: EngineCoreClient) runs it in
an engine-core process (``process.py``) with a transport of ZeroMQ sockets.

    each iteration:
      receive commands   wait 0.25 s when idle, 20 ms while only compiles are in progress,
                         not at all when there is work; None: the client is gone -> end
      apply them         AddRequest -> admitted (answers for all adds of the iteration);
                           one with a structured-output spec waits for EngineCore.prepare
                           (its grammar, compiled in a thread) and is admitted when ready
                         AbortRequests -> aborted   UtilityCall -> answer   Shutdown -> end
      idle and a worker lost (EngineCore.health) -> dead, end
      step if any work   -> report(outputs, or the StepFailedError that failed only its
                            own requests; gauges); an iteration without a step reports
                            nothing but the gauges, which is the heartbeat

Any other exception (EngineDeadError: a lost worker) -> dead: the transport fails every
open request, and the loop ends.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from treadle.config import TreadleError
from treadle.engine.core.messages import (
    AbortRequests,
    AddRequest,
    EngineSnapshot,
    Shutdown,
    StepResult,
    ToCore,
    UtilityCall,
)
from treadle.engine.outputs import RequestOutput

if TYPE_CHECKING:  # the loop is handed its core: this module stays torch-free (the API process imports it)
    from treadle.engine.core.engine_core import EngineCore

logger = logging.getLogger("treadle")

IDLE_WAIT_S = 0.25  # how often an idle loop wakes to report its heartbeat
COMPILE_WAIT_S = 0.02  # how often a loop with nothing but compiles in progress looks at them


class CoreTransport(ABC):
    """The loop's side of the wire to its client. Every method is called from the loop's
    thread only; none may block on the client."""

    @abstractmethod
    def receive(self, wait_s: float) -> list[ToCore] | None:
        """The commands that have arrived, in order, waiting up to ``wait_s`` for the first
        (0: not at all); [] when none came. None: the client is gone, the loop ends."""

    @abstractmethod
    def admitted(self, results: list[tuple[str, TreadleError | None]]) -> None:
        """Answers to AddRequests, by request id: None means queued, else why not."""

    @abstractmethod
    def aborted(self, request_ids: list[str], finals: list[RequestOutput]) -> None:
        """These requests were aborted; ``finals``: the last outputs of those that were running."""

    @abstractmethod
    def report(self, result: StepResult, snapshot: EngineSnapshot) -> None:
        """One iteration's end: the step's outputs (or its failure), then the gauges; sent
        every iteration, so it is also the heartbeat. The gauges must be visible to a caller
        by the time it sees the outputs."""

    @abstractmethod
    def answer(self, call_id: int, value: Any, error: BaseException | None) -> None:
        """The result of a UtilityCall."""

    @abstractmethod
    def dead(self, reason: str) -> None:
        """The engine cannot go on and the loop ends: every open request must fail."""


class CoreLoop:
    def __init__(self, core: EngineCore, transport: CoreTransport) -> None:
        self.core, self.transport = core, transport
        self.stop = False
        self.compiling: dict[str, tuple[AddRequest, Future[None]]] = {}  # adds waiting for their grammar
        self.aborted_compiling: set[str] = set()

    def run(self) -> None:
        """Iterate until Shutdown, the client's departure or the engine's death."""
        try:
            while not self.stop:
                wait = 0.0 if self.core.has_work() else COMPILE_WAIT_S if self.compiling else IDLE_WAIT_S
                commands = self.transport.receive(wait)
                if commands is None:
                    return
                self._apply(commands)
                if self.compiling:
                    self._admit_compiled()
                if not self.core.has_work() and (problem := self.core.health()) is not None:
                    self.transport.dead(problem)
                    return
                result = self.core.step() if self.core.has_work() and not self.stop else StepResult([])
                self.transport.report(result, self.core.snapshot())
        except BaseException as e:  # noqa: BLE001 - any failure must release the clients
            logger.exception("engine step failed; failing all open requests")
            self.transport.dead(f"engine step failed: {e!r}")

    def _apply(self, commands: list[ToCore]) -> None:
        admitted: list[tuple[str, TreadleError | None]] = []
        for msg in commands:
            if self.stop:
                break  # what came after Shutdown is the client's to fail
            if isinstance(msg, AddRequest):
                future = self.core.prepare(msg.params)
                if future is None:
                    admitted.append((msg.request_id, self._admit(msg)))
                else:
                    self.compiling[msg.request_id] = (msg, future)
            elif isinstance(msg, AbortRequests):
                if admitted:  # answered before the abort, so a client sees the two in order
                    self.transport.admitted(admitted)
                    admitted = []
                # an add still compiling is refused when its compile ends
                self.aborted_compiling.update(rid for rid in msg.request_ids if rid in self.compiling)
                self.transport.aborted(msg.request_ids, self.core.abort(msg.request_ids))
            elif isinstance(msg, UtilityCall):
                self._utility(msg)
            elif isinstance(msg, Shutdown):
                self.stop = True
        if admitted:
            self.transport.admitted(admitted)

    def _admit_compiled(self) -> None:
        """Admit (or refuse, with the compile's error) each add whose grammar is ready."""
        admitted: list[tuple[str, TreadleError | None]] = []
        for rid, (msg, future) in list(self.compiling.items()):
            if not future.done():
                continue
            del self.compiling[rid]
            error = future.exception()
            if rid in self.aborted_compiling:
                self.aborted_compiling.discard(rid)
                admitted.append((rid, TreadleError("the request was aborted while its grammar compiled")))
            elif isinstance(error, TreadleError):
                admitted.append((rid, error))
            elif error is not None:
                admitted.append((rid, TreadleError(f"the grammar did not compile: {error!r}")))
            else:
                admitted.append((rid, self._admit(msg)))
        if admitted:
            self.transport.admitted(admitted)

    def _admit(self, msg: AddRequest) -> TreadleError | None:
        try:
            self.core.admit(msg.request_id, msg.prompt, msg.params, msg.priority, msg.max_waiting, msg.arrival_time)
        except TreadleError as e:
            return e
        return None

    def _utility(self, call: UtilityCall) -> None:
        method = UTILITIES.get(call.method)
        if method is None:
            self.transport.answer(call.call_id, None, TreadleError(f"no utility call {call.method!r}"))
            return
        try:
            value = method(self.core, *call.args)
        except Exception as e:  # noqa: BLE001 - a failed call is the caller's error, not the engine's
            self.transport.answer(call.call_id, None, e)
            return
        self.transport.answer(call.call_id, value, None)


def _ping(core: EngineCore) -> int:
    return os.getpid()


def _snapshot(core: EngineCore) -> dict[str, Any]:
    return dataclasses.asdict(core.snapshot())


# utility calls a client may make (EngineCoreClient.call_utility): name -> fn(core, *args)
UTILITIES: dict[str, Callable[..., Any]] = {"ping": _ping, "snapshot": _snapshot}
