"""LLMEngine: one step loop over the scheduler (LLM Manager) and the workers (Text Generator),
reached only through an Executor. Synchronous; the async engine and the server drive it.

    EngineArgs --resolve_config--> EngineConfig --create_executor--> workers (model, KV cache)
    step: Scheduler.schedule -> Executor.execute -> Scheduler.update_from_output -> outputs

Under pipeline parallelism the step is a batch queue: schedule and submit until
``executor.max_concurrent_batches`` steps are in flight (or nothing more can be scheduled),
then collect the oldest and process it, so stage k works on one step while stage k+1 works
on the one before.
"""
from __future__ import annotations

import itertools
import logging
import signal
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from treadle.config import EngineConfig, EngineDeadError, InvalidRequestError, StepFailedError, TreadleError
from treadle.core.cost_policy import runs_to_max_tokens
from treadle.core.kv_cache_manager import KVCacheManager
from treadle.core.kv_groups import kv_groups
from treadle.core.request import Request, RequestStatus
from treadle.core.scheduler import Scheduler
from treadle.core.spec_fallback import FallbackController
from treadle.core.step_data import ModelRunnerOutput, SchedulerOutput
from treadle.engine.args import EngineArgs, engine_args
from treadle.engine.inputs import PromptType
from treadle.engine.memory import fmt_bytes
from treadle.engine.output_processor import OutputProcessor
from treadle.engine.outputs import RequestOutput
from treadle.engine.resolver import create_engine_config
from treadle.engine.stats import EngineStats, StepSeconds
from treadle.executor import Executor, create_executor
from treadle.executor.uniproc import UniProcExecutor
from treadle.kv_transfer.scheduler import KVTransferScheduler
from treadle.loaders import ModelSource, open_model_source
from treadle.predict.model import LengthPredictor
from treadle.sampling_params import SamplingParams
from treadle.structured import StructuredOutputsParams
from treadle.tokenizer import Tokenizer

if TYPE_CHECKING:
    from treadle.worker.model_runner import ModelRunner

logger = logging.getLogger("treadle")


class LLMEngine:
    def __init__(self, config: EngineConfig, source: ModelSource | None = None) -> None:
        """``config`` from ``resolve_config``; ``source``: the checkpoint it was resolved from
        (opened again from ``config.load.model_path`` when not given)."""
        source = source if source is not None else open_model_source(config.load.model_path)
        self.config = config
        self.model_config, self.tokenizer = source.config, source.tokenizer
        self._source = source
        self.scheduler_config = config.scheduler
        self.executor: Executor = create_executor(config, source)
        capacity = self.executor.kv_capacity()
        logger.info("KV cache: %d blocks x %d tokens (%s, %s), attention backend %s, executor %s",
                    capacity.num_blocks, capacity.block_size,
                    fmt_bytes(capacity.num_blocks * config.cache.bytes_per_block), config.cache.kv_cache_dtype,
                    config.attention_backend,
                    config.parallel.distributed_executor_backend)
        groups = kv_groups(self.model_config, config.cache.hybrid_kv)
        if groups.hybrid:
            logger.info("hybrid KV: %d block tables per request, a block holds %d layers; windows %s",
                        len(groups.groups), groups.group_size, list(groups.windows))
        self.kv_manager = KVCacheManager(capacity.num_blocks, capacity.block_size,
                                         config.cache.enable_prefix_caching, groups.windows)
        spec = config.speculative
        self.spec = None if spec is None else FallbackController(spec.fallback)
        sched_kw: dict[str, Any] = dict(max_batches=self.executor.max_concurrent_batches,
                                        send_token_ids=config.parallel.pipeline_parallel_size > 1,
                                        lookahead_slots=0 if spec is None else spec.lookahead_slots)
        self.scheduler = (Scheduler(config.scheduler, self.kv_manager, self.spec, **sched_kw)
                          if config.kv_transfer is None else
                          KVTransferScheduler(config.scheduler, self.kv_manager, self.spec, config.kv_transfer, **sched_kw,
                                              tp_size=config.parallel.tensor_parallel_size))
        # submitted, not collected: (step, start time, the exception its submit raised, if any)
        self._in_flight: deque[tuple[SchedulerOutput, float, Exception | None]] = deque()
        self.outputs = OutputProcessor(self.tokenizer)
        path = config.scheduler.length_predictor  # predicted output lengths, put on each request at admission
        self.length_predictor = None if path is None else LengthPredictor.load(path)
        self._ids = itertools.count()
        self.stats = EngineStats(None if self.spec is None else self.spec.stats)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        config, source = create_engine_config(args)
        return cls(config, source)

    @classmethod
    def from_args(cls, model: str | None = None, **kwargs: Any) -> LLMEngine:
        """``kwargs``: EngineArgs fields (vLLM's names); unset ones take EngineArgs' defaults."""
        return cls.from_engine_args(engine_args(model, **kwargs))

    def health(self) -> str | None:
        """None while the workers are alive, else why not (safe from any thread)."""
        return self.executor.health()

    def shutdown(self) -> None:
        """Stop the workers; the engine cannot step afterwards. Idempotent."""
        self.executor.shutdown()

    def model_runner(self) -> ModelRunner:
        """The in-process model runner (its model, KV caches, attention backend, proposer): the one
        inspection hook for tools, benchmarks and tests. Only the ``uni`` executor has one; with
        workers in other processes this is a TreadleError."""
        worker = self.executor.worker if isinstance(self.executor, UniProcExecutor) else None
        if worker is None:
            raise TreadleError(f"the {self.config.parallel.distributed_executor_backend!r} executor runs the model in other processes: "
                               "nothing to inspect here (use executor='uni')")
        return worker.runner

    # -- requests --------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt: a string, a list of token ids, or a dict
        with ``prompt`` and/or ``prompt_token_ids``. A malformed prompt is a TreadleError."""
        if isinstance(prompt, dict):
            text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
            if text is not None and not isinstance(text, str):
                raise InvalidRequestError("a prompt dict's 'prompt' must be a string", "prompt")
            if ids is None:
                if text is None:
                    raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
                return text, self.tokenizer_for("a text prompt").encode(text)
            return text, self._token_ids(ids, "prompt_token_ids")
        if isinstance(prompt, str):
            return prompt, self.tokenizer_for("a text prompt").encode(prompt)
        return None, self._token_ids(prompt, "prompt token ids")

    def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compile ``spec`` into the shared cache (thread-safe: the server calls it from its
        tokenizer thread, so the step loop finds it compiled); an invalid one is an
        InvalidRequestError naming the problem."""
        self.tokenizer_for("structured output", "structured_outputs")
        if not self.executor.prepare_grammar(spec):  # workers in other processes compile it ahead
            self._source.grammars.compile(spec)

    def tokenizer_for(self, what: str, param: str = "prompt") -> Tokenizer:
        """The tokenizer; without one (skip_tokenizer_init) ``what`` is refused, naming the way out."""
        if self.tokenizer is None:
            raise InvalidRequestError(f"{what} needs a tokenizer, and this engine was started with "
                                      "skip_tokenizer_init; send token ids (prompt_token_ids) instead", param)
        return self.tokenizer

    def _token_ids(self, ids: object, what: str, param: str = "prompt") -> list[int]:
        """``ids`` as a list of ints in the vocabulary, or an InvalidRequestError naming ``what``."""
        vocab = self.model_config.vocab_size
        if not isinstance(ids, (list, tuple)):
            raise InvalidRequestError(f"{what} must be a list of integers, not {type(ids).__name__}", param)
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool):
                raise InvalidRequestError(f"{what} must be integers; got {t!r}", param)
            if not 0 <= t < vocab:
                raise InvalidRequestError(f"{what} must be in [0, {vocab}); got {t}", param)
        return list(ids)

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None, fit_max_tokens: bool = False) -> str:
        """Validate the request completely, then queue it; on any TreadleError nothing is queued.
        ``fit_max_tokens`` (the offline API, as vLLM's): a ``max_tokens`` that would run past
        ``max_model_len`` stops there instead of refusing the request (the server refuses, as
        OpenAI does)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TreadleError(f"sampling params must be a SamplingParams, not {type(params).__name__}")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.outputs.parents:
            raise TreadleError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        if params.stop:
            self.tokenizer_for("a stop string", "stop")
        if params.structured_outputs is not None:
            self.compile_grammar(params.structured_outputs)
        self._token_ids(params.stop_token_ids, "stop_token_ids", "stop_token_ids")
        max_len = self.scheduler_config.max_model_len
        max_tokens = params.max_tokens if params.max_tokens is not None else max(1, max_len - len(ids))
        if fit_max_tokens and len(ids) < max_len:
            max_tokens = min(max_tokens, max_len - len(ids))
        arrival = time.monotonic() if arrival_time is None else arrival_time
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        reqs = [Request(cid, ids, params, max_tokens, self.model_config.stop_token_ids, arrival, priority,
                        wait_for=child_ids[0] if i else None, seed_offset=i)
                for i, cid in enumerate(child_ids)]
        if self.length_predictor is not None:
            exact = runs_to_max_tokens(params.ignore_eos, params.stop, params.stop_token_ids)
            predicted = max_tokens if exact else self.length_predictor.predict([ids])[0]
            for req in reqs:
                req.predicted_output_tokens = predicted
        self.scheduler.check_admissible(reqs[0])
        self.outputs.add(request_id, text, ids, params, child_ids, arrival)
        for req in reqs:
            self.scheduler.add_request(req)
        return request_id

    def abort_request(self, request_ids: list[str] | str) -> list[RequestOutput]:
        """Abort these requests (unknown or finished ids are ignored); their final outputs,
        ``finish_reason`` "abort" on every unfinished completion."""
        finals = []
        for pid in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self.outputs.parents.get(pid)
            if parent is None:
                continue
            for cid in parent.children:
                req = self.scheduler.requests.get(cid)
                if req is not None:
                    self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                    self.outputs.finish_child(req)
            finals.append(self.outputs.make_output(pid))  # drops the finished parent
        return finals

    def has_unfinished_requests(self) -> bool:
        """Requests are live, or steps are still in flight (they must come back first)."""
        return bool(self.outputs.parents) or bool(self._in_flight)

    # -- the step ----------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduled step. An ordinary exception inside it aborts the requests of this
        step (their blocks freed) and raises StepFailedError naming them; the engine stays
        usable. EngineDeadError (a lost worker, a dead engine) propagates unchanged. A Ctrl-C
        (in the main thread) is held until the step is done, then raised; a second one raises
        at once, and the interrupted step is failed like a raising one."""
        with _HeldInterrupt():
            return self._step()

    def _step(self) -> list[RequestOutput]:
        sched: SchedulerOutput | None = None
        try:
            t0 = time.perf_counter()
            self._fill_batch_queue()
            if not self._in_flight:
                return []
            sched, started, submit_error = self._in_flight.popleft()
            if submit_error is not None:
                raise submit_error
            result = self.executor.collect()  # EngineDeadError: the engine is dead
            t_model = time.perf_counter()
            touched = self.scheduler.update_from_output(sched, result)
            self.stats.record(sched, touched)
            self._observe_speculation(sched, result, t_model - started)
            t_update = time.perf_counter()
            updated = self.outputs.process(
                touched, result, lambda req: self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
            )
            outputs = [self.outputs.make_output(pid) for pid in updated]
            if sched.is_empty:
                self._fail_if_stuck()
            self.stats.last_step = StepSeconds(max(started - t0, 0.0), t_model - started, t_update - t_model,
                                               time.perf_counter() - t_update)
            return outputs
        except (EngineDeadError, StepFailedError):
            raise
        except Exception as e:
            failed = self._fail_step(sched)
            logger.error("engine step failed (%r); failing its %d request(s)", e, len(failed))
            raise StepFailedError(failed, e) from e
        except BaseException:  # KeyboardInterrupt, SystemExit: the step is lost; its requests give all back
            if sched is not None:
                self._fail_step(sched)
            raise

    def _fill_batch_queue(self) -> None:
        """Schedule and submit steps until ``max_concurrent_batches`` are in flight. Only the
        first may be empty (it still carries finished ids to the workers, and a step with
        nothing to run returns at once); later ones stop at the first empty schedule."""
        while len(self._in_flight) < self.executor.max_concurrent_batches:
            sched = self.scheduler.schedule()
            if self._in_flight and sched.is_empty and not sched.finished_request_ids:
                return
            started = time.perf_counter()
            try:
                self.executor.submit(sched)
            except EngineDeadError:
                raise
            except Exception as e:  # noqa: BLE001 - fails this step's requests when its turn comes
                self._in_flight.append((sched, started, e))
                return
            except BaseException:  # interrupted while the step ran in submit (one process): it is lost
                self._fail_step(sched)
                raise
            self._in_flight.append((sched, started, None))
            self.stats.max_steps_in_flight = max(self.stats.max_steps_in_flight, len(self._in_flight))
            if sched.is_empty:
                return

    def _fail_if_stuck(self) -> None:
        """After an empty step: requests wait while nothing runs, nothing is in flight and no KV
        transfer is pending, so no block will ever come free for them. Fail them (StepFailedError
        naming the cache) rather than step forever."""
        s = self.scheduler
        if self._in_flight or s.num_running or not s.num_waiting or s.has_pending_transfers():
            return
        waiting = [r.request_id for r in s.requests.values() if not r.status.finished]
        if not waiting:
            return
        parents = list(dict.fromkeys(p for c in waiting if (p := self.outputs.parent_of.get(c)) is not None))
        free, total = self.kv_manager.num_free_blocks, self.kv_manager.pool.num_blocks
        self.abort_request(parents)
        raise StepFailedError(parents, f"{len(waiting)} request(s) wait for KV blocks that cannot come free "
                                       f"({free} of {total} blocks free, nothing running)")

    def _fail_step(self, sched: SchedulerOutput | None) -> list[str]:
        """Abort the parents of the requests in ``sched`` (all running ones if scheduling
        itself failed); returns their ids."""
        if sched is not None:
            self.scheduler.step_returned(sched)
            child_ids = [s.request_id for s in sched.scheduled] + [r.request_id for r in sched.new_requests]
        else:
            child_ids = [r.request_id for r in self.scheduler.running]
        parents = list(dict.fromkeys(p for c in child_ids if (p := self.outputs.parent_of.get(c)) is not None))
        self.abort_request(parents)
        return parents

    def _observe_speculation(self, sched: SchedulerOutput, result: ModelRunnerOutput, seconds: float) -> None:
        """Every step's time goes to the fallback controller, its rows split into decode rows (a
        request running one real token, plus its drafts) and prompt rows (chunks)."""
        if self.spec is None:
            return
        decode = [s for s in sched.scheduled if s.num_scheduled_tokens - len(s.draft_token_ids) == 1]
        decode_rows = sum(s.num_scheduled_tokens for s in decode)
        self.spec.observe_step(len(decode), any(s.draft_token_ids for s in sched.scheduled),
                               sum(len(result.sampled.get(s.request_id, ())) for s in decode), seconds,
                               decode_rows, sched.total_num_scheduled_tokens - decode_rows,
                               sum(len(s.draft_token_ids) for s in decode))


class _HeldInterrupt:
    """Holds a SIGINT that arrives inside the block and raises KeyboardInterrupt when it ends,
    so the scheduler's bookkeeping is never cut half-way (a request left marked in flight keeps
    its blocks for good); a second SIGINT raises at once. Only in the main thread over Python's
    default handler; elsewhere it does nothing."""

    def __enter__(self) -> _HeldInterrupt:
        self.held, self.previous = False, None
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self.previous = signal.signal(signal.SIGINT, self._hold)
        return self

    def _hold(self, signum: int, frame: Any) -> None:
        if self.held:  # pressed again: the step itself is stuck
            self._restore()
            raise KeyboardInterrupt
        self.held = True

    def _restore(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
            self.previous = None

    def __exit__(self, kind: type[BaseException] | None, *rest: Any) -> None:
        self._restore()
        if self.held and kind is None:
            raise KeyboardInterrupt

