"""MultiprocExecutor (``"mp"``): one worker process per rank, started with torch.multiprocessing's
spawn context, driven over pyzmq on 127.0.0.1 (frames in ``messages.py``).

Each step's input is sent to every rank; every rank answers (the last with the output). While
waiting, the executor checks the worker processes' sentinels every ``_POLL_MS``: a dead worker
is an EngineDeadError within a fraction of a second, a silent one after
``TREADLE_EXECUTE_TIMEOUT_S``. Workers are stopped by ``shutdown``, by a finalizer when the
executor is collected or the interpreter exits, and stop themselves when the engine process dies.
"""
from __future__ import annotations

import logging
import multiprocessing.connection
import os
import signal
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as torch_mp
import zmq

from treadle import envs
from treadle.config import EngineConfig, EngineDeadError, InvalidRequestError, TreadleError
from treadle.core.step_data import ModelRunnerOutput, SchedulerOutput
from treadle.executor.base import KVCapacity, WorkerGroupExecutor
from treadle.executor.messages import ERR, GRAMMAR, STEP, STOP, Codec
from treadle.executor.worker_proc import WorkerSpec, worker_main
from treadle.sampling_params import STRUCTURED_PARAM, StructuredOutputsParams

logger = logging.getLogger("treadle")

_POLL_MS = 100
_REAP_TIMEOUT_S = 1.0  # how long to wait for a dead worker to be reaped before reading its exit code
_LOOPBACK = "tcp://127.0.0.1"


class MultiprocExecutor(WorkerGroupExecutor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._codec = Codec()
        self._in_flight = 0  # steps submitted and not yet collected
        self._early: dict[int, deque[tuple[bytes, bytes]]] = {}  # a rank's answers to later steps
        self._partial: dict[int, tuple[bytes, bytes]] = {}  # answers to the oldest step, while collecting it
        self._abandoned = 0  # interrupted collects (Ctrl-C): their steps' answers are read and dropped first
        self._zmq = zmq.Context()
        self._results = self._zmq.socket(zmq.PULL)
        result_port = self._results.bind_to_random_port(_LOOPBACK)
        self._inputs = [self._zmq.socket(zmq.PUSH) for _ in range(self.world_size)]
        input_ports = [s.bind_to_random_port(_LOOPBACK) for s in self._inputs]
        self._grammars = GrammarAnnouncer(self._zmq, self.world_size, self._codec)
        self._procs: list[Any] = []
        self._finalizer = weakref.finalize(self, _teardown, self._procs, self._inputs, self._results, self._grammars,
                                           self._zmq)
        ctx = torch_mp.get_context("spawn")
        dist_addr = f"tcp://127.0.0.1:{_free_port()}"
        start_timeout = envs.worker_start_timeout_s()
        try:
            for rank in range(self.world_size):
                spec = WorkerSpec(config, rank, f"{_LOOPBACK}:{input_ports[rank]}", f"{_LOOPBACK}:{result_port}",
                                  dist_addr, torch.get_num_threads(), os.getpid(), start_timeout,
                                  *self._grammars.addresses(rank))
                proc = ctx.Process(target=worker_main, args=(spec,), name=f"treadle-worker-{rank}", daemon=True)
                proc.start()
                self._procs.append(proc)
            replies = self._collect(start_timeout, "load the model")
        except BaseException:
            self.shutdown()
            raise
        first = self._codec.decode_capacity(replies[0])
        self._capacity = KVCapacity(*first)
        logger.info("mp executor: %d worker process(es) ready (pids %s)", self.world_size,
                    ", ".join(str(p.pid) for p in self._procs))

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def submit(self, sched: SchedulerOutput) -> None:
        self._check_alive()
        payload = self._codec.encode(sched)
        for sock in self._inputs:
            try:
                sock.send_multipart([STEP, payload], flags=zmq.NOBLOCK)
            except zmq.Again:
                self._die("a worker stopped taking steps (its input queue is full)")
        self._in_flight += 1

    def collect(self) -> ModelRunnerOutput:
        self._check_alive()
        assert self._in_flight > 0, "collect without a submitted step"
        self._in_flight -= 1
        while self._abandoned:  # an interrupted step's answers come first, whatever they say
            try:
                self._collect(envs.execute_timeout_s(), "finish a step")
            except RuntimeError:
                pass  # that step failed: nobody waits for it
            self._abandoned -= 1
        try:
            replies = self._collect(envs.execute_timeout_s(), "finish a step")
        except BaseException as e:
            if not isinstance(e, Exception):  # KeyboardInterrupt: its answers still come (some are in _partial)
                self._abandoned += 1
            raise
        others = [self._codec.decode_kv_output(replies[r]) for r in range(self.world_size - 1)]
        return self.merge_kv_reports(self._codec.decode_output(replies[self.world_size - 1]), others)

    def prepare_grammar(self, spec: StructuredOutputsParams) -> bool:
        """Every worker compiles ``spec`` in its grammar thread while steps go on (so the step
        that adds the request finds it compiled); returns when all have. Any thread."""
        self._grammars.prepare(spec, self.health)
        return True

    def health(self) -> str | None:
        if self._dead is not None:
            return self._dead
        lost = _dead_procs(self._procs)
        return _death_message(lost[0]) if lost else None

    def shutdown(self) -> None:
        if self._dead is None:
            self._dead = "the executor was shut down"
        self._finalizer()

    def _collect(self, timeout: float, doing: str) -> dict[int, bytes]:
        """Every rank's answer to the oldest step in flight (the payload of ready / ok / out),
        or raise. With several steps in flight a fast rank may already have answered later
        ones: those answers wait in ``_early``, in order. A rank that fails to load raises at
        once; a failed step raises once every rank has answered, so no stale answer is left."""
        loading = doing == "load the model"
        deadline = time.monotonic() + timeout
        replies = self._partial  # an interrupted collect's answers stay for the next one
        for rank, queue in self._early.items():
            if queue and rank not in replies:
                replies[rank] = queue.popleft()
        while len(replies) < self.world_size:
            if self._results.poll(_POLL_MS):
                rank_frame, kind, payload = self._results.recv_multipart()
                rank = int(rank_frame)
                if rank in replies:
                    self._early.setdefault(rank, deque()).append((kind, payload))
                    continue
                replies[rank] = (kind, payload)
                if kind == ERR and loading:
                    self._raise_worker_error(rank, payload, loading)
                continue
            lost = _dead_procs(self._procs)
            if lost:
                self._die(_death_message(lost[0]))
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(replies))
                self._die(f"worker rank(s) {missing} did not {doing} within {timeout:.0f} s "
                          f"(TREADLE_EXECUTE_TIMEOUT_S / TREADLE_WORKER_START_TIMEOUT_S); the engine stops")
        self._partial = {}
        if not loading and any(kind == ERR for kind, _ in replies.values()):
            self._keep_kv_reports(replies)
        for rank, (kind, payload) in sorted(replies.items()):
            if kind == ERR:
                self._raise_worker_error(rank, payload, loading)
        return {rank: payload for rank, (_, payload) in replies.items()}

    def _keep_kv_reports(self, replies: dict[int, tuple[bytes, bytes]]) -> None:
        last = self.world_size - 1
        self.keep_kv_reports([self._codec.decode_output(payload).kv_connector_output if rank == last
                              else self._codec.decode_kv_output(payload)
                              for rank, (kind, payload) in sorted(replies.items()) if kind != ERR])

    def _raise_worker_error(self, rank: int, payload: bytes, loading: bool) -> None:
        err = self._codec.decode_error(payload)
        if loading:  # a worker that cannot load is a start-up error, said as it is
            raise TreadleError(err.message if err.user_error else f"worker rank {rank} failed to start: {err.message}")
        raise RuntimeError(f"worker rank {rank}: {err.message}")  # the executor stays usable

    def _die(self, reason: str) -> None:
        self._dead = reason
        logger.error("mp executor: %s", reason)
        for proc in self._procs:  # the survivors of a dead group: no grace period
            if proc.is_alive():
                proc.kill()
        self._finalizer()
        raise EngineDeadError(reason)


class GrammarAnnouncer:
    """The engine's end of the workers' grammar sockets: one spec at a time (a lock) is sent
    to every rank, and its answers are awaited on a socket of its own, so any thread may
    prepare a grammar while the engine's thread drives steps on the step sockets. ``close``
    (at teardown) stops a wait within one poll before the sockets close."""

    def __init__(self, ctx: zmq.Context, world_size: int, codec: Codec) -> None:
        self.codec = codec
        self.inputs = [ctx.socket(zmq.PUSH) for _ in range(world_size)]
        self.ports = [s.bind_to_random_port(_LOOPBACK) for s in self.inputs]
        self.acks = ctx.socket(zmq.PULL)
        self.ack_port = self.acks.bind_to_random_port(_LOOPBACK)
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.seq = 0

    def addresses(self, rank: int) -> tuple[str, str]:
        return f"{_LOOPBACK}:{self.ports[rank]}", f"{_LOOPBACK}:{self.ack_port}"

    def prepare(self, spec: StructuredOutputsParams, health: Callable[[], str | None]) -> None:
        """Send ``spec`` to every rank and wait for all their answers (an InvalidRequestError
        for a bad spec; EngineDeadError when a worker is lost or the executor stops meanwhile)."""
        with self.lock:
            self.seq += 1
            payload = self.codec.encode((self.seq, spec))
            for sock in self.inputs:
                while not self._ready(sock, zmq.POLLOUT, health):  # a lost worker takes nothing
                    pass
                sock.send_multipart([GRAMMAR, payload], flags=zmq.NOBLOCK)
            waiting, errors = set(range(len(self.inputs))), []
            while waiting:
                if not self._ready(self.acks, zmq.POLLIN, health):
                    continue
                rank, answer = self.acks.recv_multipart()
                seq, error = self.codec.decode_grammar_ack(answer)
                if seq == self.seq:  # an older answer belongs to a wait that was interrupted
                    waiting.discard(int(rank))
                    errors += [error] if error is not None else []
        if errors:
            raise InvalidRequestError(errors[0], STRUCTURED_PARAM)

    def _ready(self, sock: zmq.Socket, event: int, health: Callable[[], str | None]) -> bool:
        """Whether ``sock`` is ready within one poll; raises once a worker is lost or stopped."""
        if self.stopped.is_set():
            raise EngineDeadError(health() or "the executor was shut down")
        if sock.poll(_POLL_MS, event):
            return True
        if (problem := health()) is not None:
            raise EngineDeadError(problem)
        return False

    def close(self) -> None:
        self.stopped.set()
        held = self.lock.acquire(timeout=5 * _POLL_MS / 1000)  # a wait ends within one poll
        try:
            for sock in [*self.inputs, self.acks]:
                sock.close(linger=0)
        finally:
            if held:
                self.lock.release()


def _dead_procs(procs: list[Any]) -> list[Any]:
    """Processes that have exited; reads only their sentinels, so it is safe from any thread."""
    sentinels = {p.sentinel: p for p in procs}
    return [sentinels[s] for s in multiprocessing.connection.wait(list(sentinels), timeout=0)] if procs else []


def _death_message(proc: Any) -> str:
    """Why a worker whose sentinel fired is gone. The sentinel fires before the process is
    reaped, when ``exitcode`` still reads None: join it briefly first."""
    proc.join(_REAP_TIMEOUT_S)
    code = proc.exitcode
    if code is None:
        how = "died (its exit status could not be read)"
    elif code < 0:
        how = f"was killed by {_signal_name(-code)}"
    else:
        how = f"exited with code {code}"
    return f"worker process {proc.name} (pid {proc.pid}) {how}; the engine cannot continue"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _teardown(procs: list[Any], inputs: list[zmq.Socket], results: zmq.Socket, grammars: GrammarAnnouncer,
              ctx: zmq.Context) -> None:
    """Stop every worker (politely, then by force) and close the sockets. Idempotent."""
    grammars.close()
    for sock in inputs:
        if not sock.closed:
            try:
                sock.send_multipart([STOP, b""], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
    deadline = time.monotonic() + envs.worker_stop_grace_s()
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)
    for sock in [*inputs, results]:
        sock.close(linger=0)
    ctx.term()
