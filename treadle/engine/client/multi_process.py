"""EngineCoreClient: the EngineClient whose step loop runs in an engine-core process.

The API process keeps what is cheap and per-request (tokenizing prompts, HTTP, the
asyncio queues); the engine process (``core/process.py``) owns the LLMEngine, its
scheduler, KV cache, model and detokenizer, and runs the one step loop (``core/loop.py``)
with a ZeroMQ transport. Two ZeroMQ pipes on ipc:// sockets join them (messages in
``core/messages.py``):

    API process                                         engine-core process
    -----------                                         -------------------
    event loop: admit / abort / call_utility
        --> input PUSH ==== AddRequest, AbortRequests ==> PULL   CoreLoop
    reader thread: one poll on output + process sentinel          LLMEngine.step()
        <-- output PULL <== Admitted, StepReport, RequestsFailed, EngineDead == PUSH
        -> futures of pending adds; RequestOutputs rebuilt from deltas and posted
           to each OutputGroup's event loop; gauges and heartbeat kept for /health

The reader thread notices the engine process's death at once (its sentinel is in the
poll): every open request then fails with EngineDeadError and health reports it.
The engine process exits by itself if this process dies.

This process never opens the checkpoint and imports no torch (a test checks it): the engine's
``Ready`` brings the model's config and tokenizer, the engine is built from a factory that only
the engine process calls, and the engine process picks its own default thread count.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import multiprocessing
import multiprocessing.util
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from treadle.config import EngineDeadError, InvalidRequestError, StepFailedError, TreadleError
from treadle.engine.client.engine_client import EngineClient, Sink, post_by_loop, settle
from treadle.engine.core.loop import IDLE_WAIT_S
from treadle.engine.core.messages import (
    AbortRequests,
    AddRequest,
    Admitted,
    EngineDead,
    EngineSnapshot,
    FromCore,
    Ready,
    RequestsFailed,
    Shutdown,
    StartupFailed,
    StepReport,
    UtilityCall,
    UtilityResult,
    WireOutput,
    encoder,
    from_core_decoder,
    from_wire,
)
from treadle.engine.core.process import engine_from_args, run_engine_core
from treadle.engine.inputs import PromptType
from treadle.engine.outputs import CompletionOutput, Logprob, RequestOutput
from treadle.predict.model import LengthPredictor
from treadle.sampling_params import SamplingParams, StructuredOutputsParams
from treadle.tokenizer import Tokenizer

if TYPE_CHECKING:
    from treadle.engine.llm_engine import LLMEngine

logger = logging.getLogger("treadle")

IDLE_WAIT_MS = int(IDLE_WAIT_S * 1000)  # how often the reader thread looks at the engine process


class _Stream:
    """One request's outputs as the client rebuilds them from the engine's deltas."""

    def __init__(self, sink: Sink, prompt: str | None, prompt_token_ids: list[int]) -> None:
        self.sink, self.prompt, self.prompt_token_ids = sink, prompt, prompt_token_ids
        self.token_ids: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[dict[int, Logprob]]] = {}
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def rebuild(self, w: WireOutput) -> RequestOutput:
        if w.prompt_logprobs is not None:
            self.prompt_logprobs = w.prompt_logprobs
        outputs = []
        for c in w.completions:
            ids = self.token_ids.setdefault(c.index, [])
            ids.extend(c.new_token_ids)
            logprobs = None
            if c.new_logprobs is not None:
                logprobs = self.logprobs.setdefault(c.index, [])
                logprobs.extend(c.new_logprobs)
            outputs.append(CompletionOutput(c.index, c.text, list(ids), c.cumulative_logprob, logprobs,
                                            c.finish_reason, c.stop_reason, c.new_text, c.new_token_ids))
        return RequestOutput(w.request_id, self.prompt, self.prompt_token_ids, outputs, w.finished,
                             self.prompt_logprobs, w.metrics, w.kv_transfer_params)


class EngineCoreClient(EngineClient):
    def __init__(self, engine_factory: Callable[[], LLMEngine], heartbeat_timeout: float = 60.0,
                 threads: int | None = None, startup_timeout: float = 1800.0, spare_threads: int = 0) -> None:
        """Start an engine process running ``engine_factory()`` (picklable: it travels to a
        spawned process); returns once the engine is ready, with its model config and its
        tokenizer (None under skip_tokenizer_init), or raises TreadleError (with the engine's
        own error). ``threads``: the engine process's torch threads (default: torch's
        default there, less ``spare_threads``)."""
        self.heartbeat_timeout = heartbeat_timeout
        self.dead_error: BaseException | None = None
        self.snapshot = EngineSnapshot()
        self.num_open_requests = 0
        self._lock = threading.Lock()  # guards the tables below and dead_error
        self._streams: dict[str, _Stream] = {}
        self._pending: dict[str, concurrent.futures.Future[None]] = {}
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._heartbeat = time.monotonic()
        self._closing = False
        self._send_lock = threading.Lock()
        self._enc, self._dec = encoder(), from_core_decoder()
        self._dir = Path(tempfile.mkdtemp(prefix="treadle-engine-"))
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.LINGER, 0)
        self._output = self._ctx.socket(zmq.PULL)
        self._input.bind(f"ipc://{self._dir}/input")
        self._output.bind(f"ipc://{self._dir}/output")
        log_level = logging.getLogger("treadle").getEffectiveLevel()
        self._proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, name="treadle-engine-core",
            args=(engine_factory, f"ipc://{self._dir}/input", f"ipc://{self._dir}/output",
                  threads, spare_threads, log_level))
        self._proc.start()
        self._reap_lock = threading.Lock()  # one thread at a time waits on the process (see _reap)
        # if this client is never shut down, still reap the engine before multiprocessing joins it at exit
        multiprocessing.util.Finalize(self, _kill, args=(self._proc,), exitpriority=10)
        try:
            self.max_model_len = self._await_ready(startup_timeout)
        except BaseException:
            self._close(1.0)
            raise
        self._reader = threading.Thread(target=self._read_loop, name="treadle-engine-client", daemon=True)
        self._reader.start()

    @classmethod
    def from_args(cls, model: str, heartbeat_timeout: float = 60.0, threads: int | None = None,
                  **engine_kwargs: Any) -> EngineCoreClient:
        return cls(functools.partial(engine_from_args, model, **engine_kwargs), heartbeat_timeout, threads)

    @property
    def engine_pid(self) -> int | None:
        return self._proc.pid

    # -- caller side -------------------------------------------------------------------
    async def admit(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int,
                    max_waiting: int | None, sink: Sink) -> None:
        text, ids, wire_prompt = self._prompt(prompt)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            if self.dead_error is not None:
                raise EngineDeadError(f"the engine is not running ({self.dead_error})")
            if request_id in self._streams or request_id in self._pending:
                raise TreadleError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = _Stream(sink, text, ids)
            self._pending[request_id] = done
        try:
            self._send(AddRequest(request_id, wire_prompt, params, priority, max_waiting, time.monotonic()))
        except BaseException as e:  # not queued: forget it
            with self._lock:
                self._streams.pop(request_id, None)
                self._pending.pop(request_id, None)
            if isinstance(e, (OverflowError, TypeError, ValueError)):  # a value the wire format cannot carry
                raise InvalidRequestError(f"the request holds a value the engine cannot take: {e}") from None
            raise
        await asyncio.wrap_future(done)

    def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """Not compiled here (a grammar compiled in this process would serve nothing): the
        engine process compiles it once, in a thread beside its step loop, before admitting the
        request, and refuses a bad spec then; the server has checked it first, under its
        compile budget (treadle/structured/probe.py)."""
        if self.tokenizer is None:
            raise InvalidRequestError("structured output needs a tokenizer, and this engine was started with "
                                      "skip_tokenizer_init", "structured_outputs")

    def _prompt(self, prompt: PromptType) -> tuple[str | None, list[int], Any]:
        """(prompt text, prompt ids, what to send). The server sends prompts it has already
        tokenized (on a worker thread), which go as they are, as do ids and malformed
        prompts (the engine checks them); a bare text from a Python caller is tokenized
        here, as the engine would (without a tokenizer it goes as it is: the engine refuses it)."""
        text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
        if not isinstance(text, str) or (isinstance(prompt, dict) and "prompt_token_ids" in prompt):
            ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
            return (text if isinstance(text, str) else None), (list(ids) if isinstance(ids, list) else []), prompt
        if self.tokenizer is None:
            return text, [], prompt
        ids = self.tokenizer.encode(text)
        return text, ids, {"prompt": text, "prompt_token_ids": ids}

    def abort(self, request_ids: list[str] | str) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        with self._lock:
            for rid in ids:
                self._streams.pop(rid, None)
            if self.dead_error is not None:
                return
        with contextlib.suppress(EngineDeadError):  # a dead engine has no requests left to abort
            self._send(AbortRequests(ids))

    async def call_utility(self, method: str, *args: Any, timeout: float = 30.0) -> Any:
        """Run ``core.loop.UTILITIES[method](core, *args)`` in the engine process, between steps."""
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        call_id = next(self._call_ids)
        with self._lock:
            if self.dead_error is not None:
                raise EngineDeadError(f"the engine is not running ({self.dead_error})")
            self._calls[call_id] = done
        try:
            self._send(UtilityCall(call_id, method, list(args)))
        except EngineDeadError:
            with self._lock:
                self._calls.pop(call_id, None)
            raise
        return await asyncio.wait_for(asyncio.wrap_future(done), timeout)

    def is_alive(self) -> bool:
        return self.dead_error is None and self._reader.is_alive()

    def heartbeat_age(self) -> float:
        return time.monotonic() - self._heartbeat

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._closing:
            return
        self._closing = True
        with contextlib.suppress(EngineDeadError):
            self._send(Shutdown())
        self._close(timeout)

    def _close(self, timeout: float) -> None:
        self._closing = True
        if not self._reap(timeout):
            logger.warning("the engine process did not stop within %.0f s; killing it", timeout)
            _kill(self._proc)
        reader = getattr(self, "_reader", None)
        if reader is not None:
            reader.join(timeout)
        self._fail_everything(EngineDeadError("the engine was shut down"))
        with self._send_lock:
            self._input.close(linger=0)
            self._output.close(linger=0)
            self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _reap(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the engine process to exit; True once it has (reaped).
        The reader thread and shutdown may both wait: without the lock the loser's waitpid finds
        no child, multiprocessing then reports the process alive, and shutdown would warn and
        signal a PID that is already gone."""
        with self._reap_lock:
            self._proc.join(timeout)
            return self._proc.exitcode is not None

    def _send(self, msg: Any) -> None:
        """Queue ``msg`` for the engine; EngineDeadError if no engine process is connected
        (it died; the reader thread is about to say so)."""
        with self._send_lock:
            if self._input.closed:
                raise EngineDeadError("the engine was shut down")
            try:
                self._input.send(self._enc.encode(msg), zmq.NOBLOCK, copy=False)
            except zmq.Again:
                raise EngineDeadError("the engine process is not connected") from None

    # -- start-up and the reader thread ----------------------------------------------------
    def _await_ready(self, timeout: float) -> int:
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        poller.register(self._proc.sentinel, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            events = dict(poller.poll(IDLE_WAIT_MS))
            if self._output in events:
                msg = self._dec.decode(self._output.recv())
                if isinstance(msg, StartupFailed):
                    raise from_wire(msg.error)
                if isinstance(msg, Ready):
                    self.snapshot, self._heartbeat = msg.snapshot, time.monotonic()
                    self.model_config, self.max_num_seqs = msg.model_config, msg.max_num_seqs
                    self.tokenizer = None if msg.tokenizer is None else Tokenizer.from_dict(msg.tokenizer)
                    self.length_predictor = None if msg.length_predictor is None else \
                        LengthPredictor.load(msg.length_predictor)
                    return msg.max_model_len
            elif self._proc.sentinel in events:
                self._proc.join(1)
                raise TreadleError(f"the engine process exited with code {self._proc.exitcode} while starting")
        raise TreadleError(f"the engine did not start within {timeout:.0f} s")

    def _read_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        poller.register(self._proc.sentinel, zmq.POLLIN)
        while self.dead_error is None:
            events = dict(poller.poll(IDLE_WAIT_MS))
            if self._output in events:
                self._drain_output()
            elif self._proc.sentinel in events:
                self._drain_output()  # whatever it said before it went
                self._reap(1.0)
                reason = ("the engine was shut down" if self._closing
                          else f"the engine process died (exit code {self._proc.exitcode})")
                if not self._closing:
                    logger.error("%s; failing all open requests", reason)
                self._fail_everything(EngineDeadError(reason))

    def _drain_output(self) -> None:
        while True:
            try:
                frame = self._output.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(self._dec.decode(frame.buffer))

    def _handle(self, msg: FromCore) -> None:
        if isinstance(msg, StepReport):
            self.snapshot, self._heartbeat = msg.snapshot, msg.heartbeat  # before the outputs that follow it
            self._dispatch(msg.outputs)
        elif isinstance(msg, RequestsFailed):
            self._fail_requests(StepFailedError(msg.request_ids, msg.reason))
        elif isinstance(msg, Admitted):
            for request_id, error in msg.results:
                with self._lock:
                    done = self._pending.pop(request_id, None)
                    if error is not None:
                        self._streams.pop(request_id, None)
                if done is not None:
                    settle(done, None, None if error is None else from_wire(error))
        elif isinstance(msg, UtilityResult):
            with self._lock:
                call = self._calls.pop(msg.call_id, None)
            if call is not None:
                settle(call, msg.value, None if msg.error is None else from_wire(msg.error))
        elif isinstance(msg, EngineDead):
            logger.error("%s; failing all open requests", msg.reason)
            self._fail_everything(EngineDeadError(msg.reason))

    def _dispatch(self, outputs: list[WireOutput]) -> None:
        items: list[tuple[Sink, Any]] = []
        with self._lock:
            for w in outputs:
                stream = self._streams.get(w.request_id)
                if stream is None:
                    continue  # aborted meanwhile
                items.append((stream.sink, stream.rebuild(w)))
                if w.finished:
                    del self._streams[w.request_id]
        post_by_loop(items)  # one wake-up of each event loop per step

    def _fail_requests(self, error: StepFailedError) -> None:
        """A failed step's requests receive its error; the others go on."""
        with self._lock:
            streams = [s for rid in error.request_ids if (s := self._streams.pop(rid, None)) is not None]
        post_by_loop([(s.sink, error) for s in streams])

    def _fail_everything(self, error: EngineDeadError) -> None:
        with self._lock:
            if self.dead_error is None:
                self.dead_error = error
            streams, self._streams = list(self._streams.values()), {}
            waiting = [*self._pending.values(), *self._calls.values()]
            self._pending, self._calls = {}, {}
        post_by_loop([(s.sink, error) for s in streams])
        for done in waiting:
            if not done.done():
                done.set_exception(error)


def _kill(proc: multiprocessing.process.BaseProcess) -> None:
    if proc.is_alive():
        proc.kill()
        proc.join(5)
