"""EngineCore: what the step loop (``loop.py``) does to an ``LLMEngine``, whichever
client it serves: admission with backpressure, the handling of requests the engine
cannot take, the grammar compile an add waits for, a step whose failure is its own
requests', and the gauges that /metrics reads. It is not thread-safe: one loop owns it.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

from treadle.config import QueueFullError, StepFailedError, TreadleError
from treadle.core.cost_policy import predicted_remaining
from treadle.engine.core.messages import EngineSnapshot, StepResult
from treadle.engine.inputs import PromptType
from treadle.engine.llm_engine import LLMEngine
from treadle.engine.outputs import RequestOutput
from treadle.kv_transfer.scheduler import KVTransferScheduler
from treadle.sampling_params import SamplingParams

logger = logging.getLogger("treadle")


class EngineCore:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._compiler: ThreadPoolExecutor | None = None  # started by the first structured-output add

    def prepare(self, params: SamplingParams) -> Future[None] | None:
        """The work an add needs before ``admit`` that must not hold up the step loop: its
        structured-output grammar, compiled in a thread (xgrammar drops the GIL; a spec
        compiled before is a cache hit). A future that ends with the compile (its exception:
        the spec's problem), or None when there is nothing to wait for."""
        spec = params.structured_outputs
        if spec is None:
            return None
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(1, thread_name_prefix="treadle-grammar")
        return self._compiler.submit(self.engine.compile_grammar, spec)

    def admit(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int,
              max_waiting: int | None, arrival_time: float) -> None:
        """Queue one request, or raise a TreadleError saying why not (too long, queue full,
        unreadable). A request the engine fails on is rolled back; the engine stays usable."""
        waiting = self.engine.scheduler.num_waiting  # sequences, not requests
        if max_waiting is not None and waiting and waiting + params.n > max_waiting:
            raise QueueFullError(f"{waiting} sequences are already waiting (limit {max_waiting})")
        try:
            self.engine.add_request(request_id, prompt, params, priority, arrival_time)
        except TreadleError:
            raise
        except Exception as e:  # noqa: BLE001 - a request the engine cannot take must not stop the loop
            logger.exception("add_request failed for %s", request_id)
            self.engine.abort_request(request_id)
            raise TreadleError(f"the engine could not admit the request: {e}") from None

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        return self.engine.abort_request(request_ids)

    def has_work(self) -> bool:
        """Requests to step, or KV transfers to see through (P/D: held or loading blocks)."""
        return self.engine.has_unfinished_requests() or self.engine.scheduler.has_pending_transfers()

    def step(self) -> StepResult:
        """One engine step. A StepFailedError fails only its own requests (the engine has
        aborted them; the result names them) and the loop goes on; any other exception
        (EngineDeadError: a lost worker) propagates and ends the loop."""
        try:
            return StepResult(self.engine.step())
        except StepFailedError as e:  # the engine has logged it
            return StepResult([], e)

    def health(self) -> str | None:
        """None while the engine's workers are alive, else why not (an idle engine learns
        of a lost worker only here; a busy one from its failing step)."""
        return self.engine.health()

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)
        self.engine.shutdown()

    def snapshot(self) -> EngineSnapshot:
        eng = self.engine
        kv = eng.kv_manager
        return EngineSnapshot(
            num_running=eng.scheduler.num_running, num_waiting=eng.scheduler.num_waiting,
            kv_usage=kv.usage(), num_free_blocks=kv.num_free_blocks, num_blocks=kv.pool.num_blocks,
            num_preemptions=eng.stats.num_preemptions, num_steps=eng.stats.num_steps,
            num_generated_tokens=eng.stats.num_generated_tokens, num_computed_tokens=eng.stats.num_tokens_computed,
            spec_decode=None if eng.stats.spec_decode is None else eng.stats.spec_decode.as_dict(),
            num_waiting_prompt_tokens=sum(max(0, r.num_prompt_tokens - r.num_computed_tokens)
                                          for r in eng.scheduler.requests.values()),
            kv_transfer=eng.scheduler.stats() if isinstance(eng.scheduler, KVTransferScheduler) else None,
            predicted_remaining_tokens=None if eng.length_predictor is None else
            sum(predicted_remaining(r) for r in eng.scheduler.requests.values()),
        )
