"""RayExecutor (``"ray"``): one Ray actor per rank, placed on the cluster by a placement group
(one bundle per rank: a GPU on CUDA, ``--threads`` CPUs on the CPU; PACK puts ranks together
where they fit, so a tensor-parallel group shares a machine before spilling to the next).

    ray start --head                         # on one machine
    ray start --address=HEAD_IP:6379         # on every other
    treadle serve MODEL -tp T -pp P --distributed-executor-backend ray    # on the head

Rank 0's actor picks the rendezvous address (its node's IP and a free port); every actor joins
the torch.distributed group there (``worker_proc.start_rank``: gloo or NCCL, a timeout on every
collective). Steps go to every actor as Ray calls; the engine waits with ``ray.wait`` in short
slices, so a dead actor or a lost node (RayActorError) is an EngineDeadError at once, and a
rank that does not answer within TREADLE_EXECUTE_TIMEOUT_S is one too. ``shutdown`` leaves the
process group, kills the actors and removes the placement group (and stops Ray when this
executor started it).
"""
from __future__ import annotations

import logging
import os
import socket
import time
from collections import deque
from typing import Any

import torch

from treadle import envs
from treadle.config import EngineConfig, EngineDeadError, TreadleError
from treadle.core.kv_connector_data import KVConnectorOutput
from treadle.core.step_data import ModelRunnerOutput, SchedulerOutput
from treadle.executor.base import KVCapacity, WorkerGroupExecutor
from treadle.sampling_params import StructuredOutputsParams

logger = logging.getLogger("treadle")

_WAIT_SLICE_S = 0.2


class RankActor:
    """The body of one rank's Ray actor (wrapped with ``ray.remote`` by the executor)."""

    def __init__(self, num_threads: int) -> None:
        torch.set_num_threads(num_threads)
        self.worker: Any = None
        self.last = False

    def rendezvous_address(self) -> str:
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def start(self, config: EngineConfig, rank: int, addr: str, timeout_s: float) -> tuple[int, int]:
        from treadle.executor.worker_proc import start_rank

        self.worker = start_rank(config, rank, addr, timeout_s)
        self.last = rank == config.parallel.world_size - 1
        return tuple(self.worker.kv_capacity())  # type: ignore[return-value]

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput | KVConnectorOutput | None:
        """The last rank's output; another rank's KV transfer report (P/D), if any."""
        out = self.worker.execute(sched)
        return out if self.last else out.kv_connector_output

    def prepare_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compile ``spec``'s grammar; called in the actor's "compile" concurrency group, so
        it runs beside ``execute`` (steps go on) instead of queueing with the steps."""
        self.worker.prepare_grammar(spec)

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise TreadleError("distributed_executor_backend 'ray' needs Ray: pip install 'treadle[ray]'") from None
    return ray


class RayExecutor(WorkerGroupExecutor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        ray = self._ray = _import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
        world = self.world_size
        self._pending: deque[list[Any]] = deque()  # object refs of the steps in flight
        self._actors: list[Any] = []
        threads = torch.get_num_threads()
        gpu = torch.device(config.device).type == "cuda"
        bundle = {"GPU": 1.0, "CPU": 1.0} if gpu else {"CPU": float(threads)}
        timeout = envs.worker_start_timeout_s()
        self._pg = placement_group([bundle] * world, strategy="PACK")
        try:
            ready, _ = ray.wait([self._pg.ready()], timeout=timeout)
            if not ready:
                raise TreadleError(f"the Ray cluster has no room for {world} workers of {bundle} "
                                   f"within {timeout:.0f} s (ray status shows what it has)")
            actor_cls = ray.remote(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                                   concurrency_groups={"compile": 1})(RankActor)
            self._actors = [actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=rank)).remote(threads)
                for rank in range(world)]
            addr = self._gather([self._actors[0].rendezvous_address.remote()], timeout, "start", loading=True)[0]
            caps = self._gather([a.start.remote(config, rank, addr, timeout) for rank, a in enumerate(self._actors)],
                                timeout, "load the model", loading=True)
        except BaseException:
            self.shutdown()
            raise
        self._capacity = KVCapacity(*caps[0])
        logger.info("ray executor: %d worker actor(s) ready", world)

    @property
    def worker_pids(self) -> list[int]:
        return self._gather([a.pid.remote() for a in self._actors], 30, "answer", loading=True)

    def submit(self, sched: SchedulerOutput) -> None:
        self._check_alive()
        self._pending.append([a.execute.remote(sched) for a in self._actors])

    def collect(self) -> ModelRunnerOutput:
        self._check_alive()
        outs = self._gather(self._pending.popleft(), envs.execute_timeout_s(), "finish a step")
        out = outs[self.world_size - 1]
        assert out is not None
        return self.merge_kv_reports(out, outs[: self.world_size - 1])

    def prepare_grammar(self, spec: StructuredOutputsParams) -> bool:
        """Every actor compiles ``spec`` beside its steps (its "compile" concurrency group);
        returns when all have, raises a bad spec's InvalidRequestError. Any thread."""
        self._check_alive()
        refs = [a.prepare_grammar.options(concurrency_group="compile").remote(spec) for a in self._actors]
        self._gather(refs, envs.execute_timeout_s(), "compile a grammar", as_raised=True)
        return True

    def health(self) -> str | None:
        return self._dead

    def shutdown(self) -> None:
        if self._dead is None:
            self._dead = "the executor was shut down"
        ray = self._ray
        if self._actors:
            ray.wait([a.stop.remote() for a in self._actors], num_returns=len(self._actors), timeout=5)
        for actor in self._actors:
            ray.kill(actor)
        self._actors = []
        if self._pg is not None:
            ray.util.remove_placement_group(self._pg)
            self._pg = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False

    def _gather(self, refs: list[Any], timeout: float, doing: str, loading: bool = False,
                as_raised: bool = False) -> list[Any]:
        """Each call's result in order, or raise: a dead actor or a lost node at once
        (EngineDeadError), a failed call once every rank has answered (TreadleError while
        loading, RuntimeError after; ``as_raised``: the TreadleError the call raised),
        no answer within ``timeout`` (EngineDeadError)."""
        ray = self._ray
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        deadline = time.monotonic() + timeout
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=_WAIT_SLICE_S)
            for ref in ready:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self._die(f"worker rank {rank} (a Ray actor) is gone ({type(e).__name__}); the engine cannot continue")
                except ray.exceptions.RayTaskError as e:
                    errors[rank] = getattr(e, "cause", None) or e
            if pending and time.monotonic() > deadline:
                missing = sorted(rank_of[r] for r in pending)
                self._die(f"worker rank(s) {missing} did not {doing} within {timeout:.0f} s "
                          f"(TREADLE_EXECUTE_TIMEOUT_S / TREADLE_WORKER_START_TIMEOUT_S); the engine stops")
        for rank, err in sorted(errors.items()):
            if as_raised and isinstance(err, TreadleError):
                raise err
            if loading:
                message = str(err) if isinstance(err, TreadleError) else f"{type(err).__name__}: {err}"
                raise TreadleError(message if isinstance(err, TreadleError)
                                   else f"worker rank {rank} failed to start: {message}")
            raise RuntimeError(f"worker rank {rank}: {type(err).__name__}: {err}")
        return [results[rank] for rank in range(len(refs))]

    def _die(self, reason: str) -> None:
        self._dead = reason
        logger.error("ray executor: %s", reason)
        for actor in self._actors:  # the survivors of a dead group
            self._ray.kill(actor)
        self._actors = []
        raise EngineDeadError(reason)
