"""The main loop of one worker process (started by MultiprocExecutor with the spawn context).

    join the gloo process group (rank, world size) on 127.0.0.1
    build the Worker (load the model, allocate the KV cache)  -> [rank, ready, capacity] or err
    loop: [step, sched] -> Worker.execute -> [rank, out, output] (last rank) /
                                             [rank, ok, its KV transfer report or b""] / err
          [stop]        -> leave
          grammar socket: [grammar, (seq, spec)] -> compiled in a thread (xgrammar drops the GIL)
                          while steps go on -> grammar-ack socket [rank, (seq, error or None)]
          nothing for a second and the parent process is gone -> leave (never an orphan)
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import zmq

from treadle import envs
from treadle.config import EngineConfig, TreadleError
from treadle.distributed import ParallelContext
from treadle.executor.messages import ERR, OK, OUT, READY, STEP, STOP, Codec, WorkerError
from treadle.executor.worker import Worker

_PARENT_CHECK_MS = 1000


@dataclass(frozen=True)
class WorkerSpec:
    config: EngineConfig
    rank: int
    input_addr: str  # zmq: this rank's step inputs (engine binds PUSH, worker connects PULL)
    result_addr: str  # zmq: replies of every rank (engine binds PULL, workers connect PUSH)
    dist_init_addr: str  # torch.distributed rendezvous, tcp://127.0.0.1:PORT
    num_threads: int  # torch intra-op threads, carried over from the engine process
    parent_pid: int
    start_timeout_s: float
    grammar_addr: str  # zmq: structured-output specs to compile ahead (engine PUSH, worker PULL)
    grammar_ack_addr: str  # zmq: their answers (engine PULL, worker PUSH from its compile thread)


def worker_main(spec: WorkerSpec) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle; it stops us
    torch.set_num_threads(spec.num_threads)
    ctx = zmq.Context()
    inputs, results = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inputs.setsockopt(zmq.LINGER, 0)
    results.setsockopt(zmq.LINGER, 2000)
    inputs.connect(spec.input_addr)
    results.connect(spec.result_addr)
    codec, rank = Codec(), str(spec.rank).encode()
    try:
        worker = _start(spec)
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the engine
        results.send_multipart([rank, ERR, codec.encode(_error(e))])
    else:
        results.send_multipart([rank, READY, codec.encode(tuple(worker.kv_capacity()))])
        _serve(worker, spec, inputs, results, codec)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        inputs.close()
        results.close()
        ctx.term()
    exit_at_once()


def exit_at_once() -> None:
    """End a spawned Treadle process that has finished cleanly (its sockets closed, its messages
    sent): output flushed, then ``os._exit(0)``, skipping the interpreter's teardown of torch and
    every module, which took ~0.65 s a process (so an engine with two workers took 0.7 s to shut
    down, 0.04 s now). Only on the normal path: an exception still ends the process the usual way,
    with its traceback and exit code 1."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _start(spec: WorkerSpec) -> Worker:
    return start_rank(spec.config, spec.rank, spec.dist_init_addr, spec.start_timeout_s)


def start_rank(config: EngineConfig, rank: int, dist_init_addr: str, timeout_s: float) -> Worker:
    """Join the process group (gloo on the CPU, NCCL on CUDA), make this rank's groups (their
    collectives time out after TREADLE_EXECUTE_TIMEOUT_S) and build its Worker. Shared by the
    mp and ray executors' workers."""
    par = config.parallel
    backend = "nccl" if torch.device(config.device).type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=dist_init_addr, rank=rank, world_size=par.world_size,
                            timeout=timedelta(seconds=timeout_s))
    ctx = ParallelContext.create(par.tensor_parallel_size, par.pipeline_parallel_size, rank,
                                 config.model.vocab_size, envs.execute_timeout_s(), config.device,
                                 expert_parallel=par.enable_expert_parallel)
    return Worker(config, rank=rank, parallel=ctx)


def _serve(worker: Worker, spec: WorkerSpec, inputs: zmq.Socket, results: zmq.Socket, codec: Codec) -> None:
    rank = str(spec.rank).encode()
    last = spec.rank == spec.config.parallel.world_size - 1
    grammars = GrammarPreparer(worker, spec, inputs.context, codec)
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    poller.register(grammars.inbox, zmq.POLLIN)
    try:
        while True:
            ready = dict(poller.poll(_PARENT_CHECK_MS))
            if not ready:
                if os.getppid() != spec.parent_pid:
                    return  # the engine process died without stopping us
                continue
            if grammars.inbox in ready and not grammars.receive():
                return
            if inputs not in ready:
                continue
            kind, payload = inputs.recv_multipart()
            if kind == STOP:
                return
            _step(worker, rank, last, kind, payload, results, codec)
    finally:
        grammars.close()


def _step(worker: Worker, rank: bytes, last: bool, kind: bytes, payload: bytes, results: zmq.Socket,
          codec: Codec) -> None:
    assert kind == STEP, kind
    try:
        out = worker.execute(codec.decode_step(payload))
    except Exception as e:  # noqa: BLE001 - reported; the engine decides
        results.send_multipart([rank, ERR, codec.encode(_error(e))])
        return
    results.send_multipart([rank, OUT, codec.encode(out)] if last else
                           [rank, OK, codec.encode_kv_output(out.kv_connector_output)])


class GrammarPreparer:
    """Compiles the specs the engine announces, one at a time in a thread beside the step
    loop; each answer goes back on a socket only that thread uses."""

    def __init__(self, worker: Worker, spec: WorkerSpec, ctx: zmq.Context, codec: Codec) -> None:
        self.worker, self.codec, self.rank = worker, codec, str(spec.rank).encode()
        self.ctx, self.ack_addr = ctx, spec.grammar_ack_addr
        self.inbox = ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.connect(spec.grammar_addr)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="treadle-grammar")
        self.acks: zmq.Socket | None = None  # made and used by the pool's thread only

    def receive(self) -> bool:
        """Take one frame; False when it says stop."""
        kind, payload = self.inbox.recv_multipart()
        if kind == STOP:
            return False
        self.pool.submit(self._compile, payload)
        return True

    def _compile(self, payload: bytes) -> None:
        seq, spec = self.codec.decode_grammar(payload)
        try:
            self.worker.prepare_grammar(spec)
            error = None
        except Exception as e:  # noqa: BLE001 - the engine refuses the request with it
            error = str(e) if isinstance(e, TreadleError) else f"{type(e).__name__}: {e}"
        if self.acks is None:
            self.acks = self.ctx.socket(zmq.PUSH)
            self.acks.setsockopt(zmq.LINGER, 0)
            self.acks.connect(self.ack_addr)
        self.acks.send_multipart([self.rank, self.codec.encode((seq, error))])

    def close(self) -> None:
        """Drop the specs not started, wait for the one compiling (the context cannot end
        while its socket is open; the executor kills a worker that takes too long)."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.acks is not None:
            self.acks.close()
        self.inbox.close()


def _error(e: BaseException) -> WorkerError:
    if isinstance(e, TreadleError):
        return WorkerError(str(e), user_error=True)
    return WorkerError(f"{type(e).__name__}: {e}", user_error=False)
