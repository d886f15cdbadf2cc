"""Executors between the engine and its workers (contract in ``executor/base.py``)."""
from __future__ import annotations

from treadle.config import EngineConfig, TreadleError
from treadle.executor.base import Executor, KVCapacity
from treadle.loaders import ModelSource

__all__ = ["Executor", "KVCapacity", "create_executor"]


def create_executor(config: EngineConfig, source: ModelSource | None = None) -> Executor:
    """The executor ``config.parallel.distributed_executor_backend`` names, with its workers
    started, loaded and their KV caches allocated. ``source``: the checkpoint the resolver
    opened, reused by an in-process worker."""
    backend = config.parallel.distributed_executor_backend
    if backend == "uni":
        from treadle.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config, source)
    if backend == "mp":
        from treadle.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    if backend == "ray":
        from treadle.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    raise TreadleError(f"distributed_executor_backend {backend!r} is not available (use 'uni', 'mp' or 'ray')")
