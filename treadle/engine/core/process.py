"""The engine-core process: owns the LLMEngine and runs the step loop (``loop.py``) away
from the API server's event loop and GIL. ``EngineCoreClient`` starts it (multiprocessing
spawn) with a picklable engine factory and the addresses of two ZeroMQ pipes it has
bound; ``ZmqCoreTransport`` is the loop's end of them (messages in ``messages.py``):

    receive   poll(input, parent sentinel); the parent gone -> None (nobody to serve: exit)
    admitted  -> Admitted (one message for the adds answered together)
    report    -> RequestsFailed (a failed step's requests), then StepReport (outputs as
                 deltas, gauges, heartbeat), every iteration
    answer    -> UtilityResult          dead -> EngineDead, and the process ends

SIGINT and SIGTERM are ignored: a Ctrl-C or a SIGTERM sent to the whole process group must
not kill the engine under the API server's graceful drain; the client's Shutdown (or the
parent's death) ends it.

The API process imports this module to name the spawn target (``run_engine_core``) and the
default engine factory (``engine_from_args``), so the module itself imports no torch and no
engine: those are imported by the two functions, which only the engine process runs.
"""
from __future__ import annotations

import logging
import multiprocessing
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from treadle.config import TreadleError
from treadle.engine.core.loop import CoreLoop, CoreTransport
from treadle.engine.core.messages import (
    Admitted,
    EngineDead,
    EngineSnapshot,
    Ready,
    RequestsFailed,
    StartupFailed,
    StepReport,
    StepResult,
    ToCore,
    UtilityResult,
    WireCompletion,
    WireOutput,
    encoder,
    to_core_decoder,
    wire_error,
)
from treadle.engine.outputs import RequestOutput

if TYPE_CHECKING:
    from treadle.engine.llm_engine import LLMEngine

logger = logging.getLogger("treadle")

LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


def engine_from_args(model: str, **engine_kwargs: Any) -> LLMEngine:
    """The default engine factory (picklable by name): ``LLMEngine.from_args``, in the engine process."""
    from treadle.engine.llm_engine import LLMEngine

    return LLMEngine.from_args(model, **engine_kwargs)


def run_engine_core(engine_factory: Callable[[], LLMEngine], input_addr: str, output_addr: str,
                    threads: int | None, spare_threads: int, log_level: int) -> None:
    """Process entry point: build the engine, say Ready, loop until Shutdown or orphaned; then
    exit at once (``exit_at_once``). ``threads``: torch's threads here; None: torch's own default
    less ``spare_threads`` (at least one), decided here because the client imports no torch."""
    import torch

    from treadle.engine.core.engine_core import EngineCore
    from treadle.executor.worker_proc import exit_at_once

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    torch.set_num_threads(threads or max(1, torch.get_num_threads() - spare_threads))
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
            sched, tokenizer = engine.scheduler_config, engine.tokenizer
            out.send(enc.encode(Ready(sched.max_model_len, core.snapshot(), engine.model_config, sched.max_num_seqs,
                                      sched.length_predictor, None if tokenizer is None else tokenizer.to_dict())))
            CoreLoop(core, ZmqCoreTransport(inp, out)).run()
        finally:
            core.shutdown()  # the executor's workers go with the engine
    finally:
        inp.close(linger=0)
        out.close()
        ctx.term()
    exit_at_once()


class ZmqCoreTransport(CoreTransport):
    """The loop's end of the two pipes to an EngineCoreClient in the parent process."""

    def __init__(self, inp: zmq.Socket, out: zmq.Socket) -> None:
        self.inp, self.out = inp, out
        self.enc = encoder()
        self.dec = to_core_decoder()
        self.poller = zmq.Poller()
        self.poller.register(inp, zmq.POLLIN)
        parent = multiprocessing.parent_process()
        self.parent_sentinel = parent.sentinel if parent is not None else None
        if self.parent_sentinel is not None:
            self.poller.register(self.parent_sentinel, zmq.POLLIN)
        self.seen: set[str] = set()  # requests that have had an output (their prompt logprobs are sent)

    def receive(self, wait_s: float) -> list[ToCore] | None:
        events = dict(self.poller.poll(int(wait_s * 1000)))
        if self.parent_sentinel is not None and self.parent_sentinel in events:
            logger.warning("the API server process is gone; the engine process exits")
            return None
        commands: list[ToCore] = []
        while self.inp in events:
            try:
                frame = self.inp.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                commands.append(self.dec.decode(frame.buffer))
            except msgspec.DecodeError:
                logger.exception("dropping an unreadable command")
        return commands

    def admitted(self, results: list[tuple[str, TreadleError | None]]) -> None:
        self._send(Admitted([(rid, None if e is None else wire_error(e)) for rid, e in results]))

    def aborted(self, request_ids: list[str], finals: list[RequestOutput]) -> None:
        self.seen.difference_update(request_ids)  # the client has forgotten them already

    def report(self, result: StepResult, snapshot: EngineSnapshot) -> None:
        if result.failed is not None:  # only that step's requests fail; the loop goes on
            self.seen.difference_update(result.failed.request_ids)
            cause = result.failed.cause
            self._send(RequestsFailed(result.failed.request_ids, cause if isinstance(cause, str) else repr(cause)))
        self._send(StepReport(self._pack(result.outputs), snapshot, time.monotonic()))

    def answer(self, call_id: int, value: Any, error: BaseException | None) -> None:
        self._send(UtilityResult(call_id, value, None if error is None else wire_error(error)))

    def dead(self, reason: str) -> None:
        self._send(EngineDead(reason))

    def _send(self, msg: Any) -> None:
        self.out.send(self.enc.encode(msg), copy=False)

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
