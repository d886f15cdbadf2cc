"""The engine-core process: owns the LLMEngine and runs its step loop, away from the
API server's event loop and GIL. ``EngineCoreClient`` starts it (multiprocessing
spawn) with a picklable engine factory and the addresses of two ZeroMQ pipes it has
bound; the messages are in ``core_messages.py``.

    loop:  poll(input, parent sentinel; wait 0.25 s when idle, not at all when busy)
           parent gone       -> exit (the API process died: nobody to serve)
           apply commands    -> Admitted (one message for all adds of the iteration)
                                a structured-output add is compiled in a thread first (xgrammar
                                drops the GIL), so the loop steps on; admitted when compiled
           step if any work  -> StepReport(outputs as deltas, gauges, heartbeat)
           step failed (StepFailedError) -> RequestsFailed(its requests), loop goes on

Any other failed step, or a lost worker noticed while idle, sends EngineDead and ends the
process (the client fails every open request). SIGINT and SIGTERM are ignored: a Ctrl-C or a SIGTERM sent to the whole
process group must not kill the engine under the API server's graceful drain; the
client's Shutdown (or the parent's death) ends it.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec
import torch
import zmq

from treadle.config import TreadleError
from treadle.engine.core_messages import (
    AbortRequests,
    AddRequest,
    Admitted,
    EngineDead,
    Ready,
    RequestsFailed,
    Shutdown,
    StartupFailed,
    StepReport,
    ToCore,
    UtilityCall,
    UtilityResult,
    WireCompletion,
    WireError,
    WireOutput,
    encoder,
    to_core_decoder,
    wire_error,
)
from treadle.engine.engine_core import EngineCore, StepResult
from treadle.engine.llm_engine import LLMEngine, StepFailedError
from treadle.engine.outputs import RequestOutput

logger = logging.getLogger("treadle")

IDLE_WAIT_MS = 250  # how often an idle loop wakes to send a heartbeat
COMPILE_WAIT_MS = 20  # how often a loop with nothing but compiles in progress looks at them
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


def run_engine_core(engine_factory: Callable[[], LLMEngine], input_addr: str, output_addr: str,
                    threads: int, log_level: int) -> None:
    """Process entry point: build the engine, say Ready, loop until Shutdown or orphaned."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    torch.set_num_threads(threads)
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.SNDHWM, 0)  # never block on a slow reader; an orphan exits within an iteration
    out.setsockopt(zmq.LINGER, 2000)  # let the last message (EngineDead) leave
    inp.connect(input_addr)
    out.connect(output_addr)
    enc = encoder()
    try:
        try:
            engine = engine_factory()
        except BaseException as e:  # noqa: BLE001 - the client reports it, as one line for a TreadleError
            if not isinstance(e, TreadleError):
                logger.exception("the engine failed to start")
            out.send(enc.encode(StartupFailed(wire_error(e))))
            return
        core = EngineCore(engine)
        try:
            out.send(enc.encode(Ready(engine.scheduler_config.max_model_len, core.snapshot())))
            CoreLoop(core, inp, out).run()
        finally:
            core.shutdown()  # the executor's workers go with the engine
    finally:
        inp.close(linger=0)
        out.close()
        ctx.term()


class CoreLoop:
    def __init__(self, core: EngineCore, inp: zmq.Socket, out: zmq.Socket) -> None:
        self.core, self.inp, self.out = core, inp, out
        self.enc = encoder()
        self.dec = to_core_decoder()
        self.poller = zmq.Poller()
        self.poller.register(inp, zmq.POLLIN)
        parent = multiprocessing.parent_process()
        self.parent_sentinel = parent.sentinel if parent is not None else None
        if self.parent_sentinel is not None:
            self.poller.register(self.parent_sentinel, zmq.POLLIN)
        self.stop = False
        self.seen: set[str] = set()  # requests that have had an output (their prompt logprobs are sent)
        self.compiling: dict[str, tuple[AddRequest, Future[None]]] = {}  # adds waiting for their grammar
        self.aborted_compiling: set[str] = set()
        self.compiler: ThreadPoolExecutor | None = None

    def run(self) -> None:
        try:
            while not self.stop:
                wait = 0 if self.core.has_work() else COMPILE_WAIT_MS if self.compiling else IDLE_WAIT_MS
                events = dict(self.poller.poll(wait))
                if self.parent_sentinel is not None and self.parent_sentinel in events:
                    logger.warning("the API server process is gone; the engine process exits")
                    return
                if self.inp in events:
                    self._apply_commands()
                if self.compiling:
                    self._admit_compiled()
                if not self.core.has_work() and (problem := self.core.health()) is not None:
                    self._send(EngineDead(problem))
                    return
                result = self.core.step() if self.core.has_work() and not self.stop else StepResult([])
                if result.failed is not None:  # only that step's requests fail; the loop goes on
                    self.seen.difference_update(result.failed.request_ids)
                    self._send(RequestsFailed(result.failed.request_ids, _cause(result.failed)))
                self._send(StepReport(self._pack(result.outputs), self.core.snapshot(), time.monotonic()))
        except BaseException as e:  # noqa: BLE001 - any failure must release the clients
            logger.exception("engine step failed; failing all open requests")
            self._send(EngineDead(f"engine step failed: {e!r}"))

    def _send(self, msg: Any) -> None:
        self.out.send(self.enc.encode(msg), copy=False)

    def _apply_commands(self) -> None:
        admitted: list[tuple[str, WireError | None]] = []
        while not self.stop:
            try:
                frame = self.inp.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                msg: ToCore = self.dec.decode(frame.buffer)
            except msgspec.DecodeError:
                logger.exception("dropping an unreadable command")
                continue
            if isinstance(msg, AddRequest) and msg.params.structured_outputs is not None:
                self._compile(msg)
            elif isinstance(msg, AddRequest):
                admitted.append((msg.request_id, self._admit(msg)))
            elif isinstance(msg, AbortRequests):
                # an add still compiling is refused when its compile ends
                self.aborted_compiling.update(rid for rid in msg.request_ids if rid in self.compiling)
                self.core.abort(msg.request_ids)
                self.seen.difference_update(msg.request_ids)
            elif isinstance(msg, UtilityCall):
                self._send(self._utility(msg))
            elif isinstance(msg, Shutdown):
                self.stop = True
        if admitted:
            self._send(Admitted(admitted))

    def _compile(self, msg: AddRequest) -> None:
        """Compile the add's grammar off the loop (a cache hit when it was compiled before)."""
        spec = msg.params.structured_outputs
        assert spec is not None
        if self.compiler is None:
            self.compiler = ThreadPoolExecutor(1, thread_name_prefix="treadle-grammar")
        self.compiling[msg.request_id] = (msg, self.compiler.submit(self.core.engine.compile_grammar, spec))

    def _admit_compiled(self) -> None:
        """Admit (or refuse, with the compile's error) each add whose grammar is ready."""
        admitted: list[tuple[str, WireError | None]] = []
        for rid, (msg, future) in list(self.compiling.items()):
            if not future.done():
                continue
            del self.compiling[rid]
            error = future.exception()
            if rid in self.aborted_compiling:
                self.aborted_compiling.discard(rid)
                admitted.append((rid, wire_error(TreadleError("the request was aborted while its grammar compiled"))))
            elif isinstance(error, TreadleError):
                admitted.append((rid, wire_error(error)))
            elif error is not None:
                admitted.append((rid, wire_error(TreadleError(f"the grammar did not compile: {error!r}"))))
            else:
                admitted.append((rid, self._admit(msg)))
        if admitted:
            self._send(Admitted(admitted))

    def _admit(self, msg: AddRequest) -> WireError | None:
        try:
            self.core.admit(msg.request_id, msg.prompt, msg.params, msg.priority, msg.max_waiting, msg.arrival_time)
        except TreadleError as e:
            return wire_error(e)
        return None

    def _utility(self, call: UtilityCall) -> UtilityResult:
        method = UTILITIES.get(call.method)
        if method is None:
            return UtilityResult(call.call_id, error=WireError("treadle", f"no utility call {call.method!r}"))
        try:
            return UtilityResult(call.call_id, value=method(self.core, *call.args))
        except Exception as e:  # noqa: BLE001 - a failed call is the caller's error, not the engine's
            return UtilityResult(call.call_id, error=wire_error(e))

    def _pack(self, outputs: list[RequestOutput]) -> list[WireOutput]:
        """Outputs as deltas: new tokens, new logprobs, prompt logprobs once."""
        wire = []
        for out in outputs:
            first = out.request_id not in self.seen
            if out.finished:
                self.seen.discard(out.request_id)
            else:
                self.seen.add(out.request_id)
            completions = [
                WireCompletion(c.index, c.text, c.new_text, c.new_token_ids,
                               None if c.logprobs is None else c.logprobs[len(c.logprobs) - len(c.new_token_ids):],
                               c.cumulative_logprob, c.finish_reason, c.stop_reason)
                for c in out.outputs
            ]
            wire.append(WireOutput(out.request_id, out.finished, completions, out.metrics,
                                   out.prompt_logprobs if first else None, out.kv_transfer_params))
        return wire


def _cause(e: StepFailedError) -> str:
    return e.cause if isinstance(e.cause, str) else repr(e.cause)


def _ping(core: EngineCore) -> int:
    return os.getpid()


def _snapshot(core: EngineCore) -> dict[str, Any]:
    return dataclasses.asdict(core.snapshot())


# utility calls a client may make (EngineCoreClient.call_utility): name -> fn(core, *args)
UTILITIES: dict[str, Callable[..., Any]] = {"ping": _ping, "snapshot": _snapshot}
