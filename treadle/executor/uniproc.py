"""UniProcExecutor: one Worker in the engine's own process (the default, ``"uni"``)."""
from __future__ import annotations

from treadle.config import EngineConfig, EngineDeadError
from treadle.core.step_data import ModelRunnerOutput, SchedulerOutput
from treadle.executor.base import Executor, KVCapacity
from treadle.executor.worker import Worker
from treadle.loaders import ModelSource


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, source: ModelSource | None = None) -> None:
        super().__init__(config)
        self.worker: Worker | None = Worker(config, rank=0, source=source)

    def kv_capacity(self) -> KVCapacity:
        return self._live_worker().kv_capacity()

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self._live_worker().execute(sched)

    def health(self) -> str | None:
        return None if self.worker is not None else "the executor was shut down"

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        self.worker = None  # the model and KV cache go with the last reference

    def _live_worker(self) -> Worker:
        if self.worker is None:
            raise EngineDeadError("the executor was shut down")
        return self.worker
