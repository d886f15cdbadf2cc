"""The Executor: the one door between the engine (scheduler + KV manager) and the workers.

Contract::

    executor = create_executor(config, source)    # EngineConfig from resolve_config; workers
                                                 # load the model and allocate their KV cache
    blocks, block_size = executor.kv_capacity()  # what every worker allocated: the scheduler's
                                                 # KVCacheManager is built with exactly this
    out = executor.execute(sched)                # SchedulerOutput -> ModelRunnerOutput, one step
    executor.submit(sched); out = executor.collect()   # the same, split: up to
                                                 # ``max_concurrent_batches`` steps in flight,
                                                 # collected in submission order (the batch
                                                 # queue that keeps every pipeline stage busy)
    executor.check_health()                      # raises EngineDeadError once a worker is lost
    executor.shutdown()                          # idempotent; workers never outlive it

- ``execute`` gets plain data and returns plain data (``core/step_data.py``); in other processes
  it travels as msgpack frames. The step runs on every worker; the output is the last rank's.
- A worker that dies, or does not answer within ``TREADLE_EXECUTE_TIMEOUT_S``, makes
  ``execute`` raise ``EngineDeadError`` (a few hundred ms after a death, never a hang); from
  then on the executor is dead: ``execute`` and ``check_health`` raise the same error.
  Any other exception from a step (a bug in the model code) is raised as it is and the
  executor stays usable: the engine decides what the step's requests get.
- ``health()`` and ``prepare_grammar(spec)`` (worker processes compile a structured-output
  grammar ahead of the step that adds its request) may be called from any thread; everything
  else from the engine's thread only.

    engine process                                    worker processes (mp)
    --------------                                    ---------------------
    LLMEngine.step --> Executor.execute(sched) --push--> rank 0 .. rank N-1: Worker.execute
                                  ^                     (torch.distributed gloo group)
                                  +-----pull---- ok / ModelRunnerOutput (last rank) / error
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from typing import NamedTuple

from treadle import envs
from treadle.config import EngineConfig, EngineDeadError
from treadle.core.kv_connector_data import KVConnectorOutput
from treadle.core.step_data import ModelRunnerOutput, SchedulerOutput
from treadle.kv_transfer.aggregate import KVOutputAggregator
from treadle.sampling_params import StructuredOutputsParams


class KVCapacity(NamedTuple):
    num_blocks: int  # per worker
    block_size: int  # tokens per block


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._done: deque[ModelRunnerOutput | Exception] = deque()  # the synchronous submit's results
        world = config.parallel.world_size
        self._kv_reports = None if config.kv_transfer is None or world == 1 else KVOutputAggregator(world)

    @property
    def max_concurrent_batches(self) -> int:
        """How many steps may be in flight at once: one per pipeline stage (only the mp and ray
        executors run stages; TREADLE_PP_BATCH_QUEUE=0 keeps one), else 1."""
        pp = self.config.parallel.pipeline_parallel_size
        return pp if pp > 1 and envs.get_flag("TREADLE_PP_BATCH_QUEUE") else 1

    def submit(self, sched: SchedulerOutput) -> None:
        """Start one step; its output comes from a later ``collect`` (FIFO). Executors
        that pipeline steps override this pair; the default runs the step now (a failed
        step raises from its ``collect``; only EngineDeadError raises here)."""
        try:
            self._done.append(self.execute(sched))
        except EngineDeadError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to collect, which raises it
            self._done.append(e)

    def collect(self) -> ModelRunnerOutput:
        """The output of the oldest submitted step (waiting for it). Raises as ``execute``."""
        out = self._done.popleft()
        if isinstance(out, Exception):
            raise out
        return out

    def prepare_grammar(self, spec: StructuredOutputsParams) -> bool:
        """Have every worker process compile ``spec``'s grammar now, off its step loop, so the
        step that carries the request does not; return when they all have (True), raise an
        InvalidRequestError naming a bad spec. Safe from any thread. False (the default): the
        model runs in this process and the caller compiles into the shared cache."""
        return False

    @abstractmethod
    def kv_capacity(self) -> KVCapacity:
        """The KV blocks each worker allocated (the same on every worker)."""

    @abstractmethod
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every worker and return the last rank's output. Raises
        EngineDeadError when a worker is gone or hung (the executor is then dead)."""

    @abstractmethod
    def health(self) -> str | None:
        """None while every worker is alive, else why not. Safe from any thread."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and free their resources; idempotent, also after a death."""

    def merge_kv_reports(self, out: ModelRunnerOutput, others: list[KVConnectorOutput | None]) -> ModelRunnerOutput:
        """P/D over several ranks: ``out`` (the last rank's) carries the instance's transfer
        report, merged from every rank's (``others``: the other ranks', in rank order)."""
        if self._kv_reports is not None:
            out.kv_connector_output = self._kv_reports.merge([*others, out.kv_connector_output])
        return out

    def keep_kv_reports(self, reports: list[KVConnectorOutput | None]) -> None:
        """A step failed on some rank: the reports the others sent with it are kept for the
        next step's output (a rank reports each transfer only once)."""
        if self._kv_reports is not None:
            self._kv_reports.add(reports)

    def check_health(self) -> None:
        """Raise EngineDeadError when ``health()`` reports a problem."""
        reason = self.health()
        if reason is not None:
            raise EngineDeadError(reason)


class WorkerGroupExecutor(Executor):
    """The parts the executors over worker processes (mp) and actors (ray) share: the
    capacity the workers reported at start, a death that is final, and ``execute`` as
    ``submit`` then ``collect`` (they pipeline steps; the pair is theirs)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.world_size = config.parallel.world_size
        self._dead: str | None = None  # why the executor is dead (a lost worker, or shut down)
        self._capacity = KVCapacity(0, 0)  # set once every worker has allocated its cache

    def kv_capacity(self) -> KVCapacity:
        return self._capacity

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(sched)
        return self.collect()

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
