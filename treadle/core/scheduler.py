"""The LLM Manager's scheduler: one token-budgeted rule, no phases.

Each request has ``num_computed_tokens`` and a target ``num_tokens`` (prompt +
generated). A step hands out ``max_num_batched_tokens``: running requests
first (decodes, or the rest of a chunked prompt), then chunks of waiting
prompts. Chunked prefill (SplitFuse), prefix-cache hits and preemption by
recompute all fall out of that rule; the policy pieces (queue order, victim
choice) are small functions below.
"""
from __future__ import annotations

from collections.abc import Iterable

from treadle.config import InvalidRequestError, SchedulerConfig
from treadle.core.kv_cache_manager import KVCacheManager
from treadle.core.outputs import ModelRunnerOutput, NewRequestData, ScheduledRequest, SchedulerOutput
from treadle.core.request import Request, RequestStatus
from treadle.core.waiting_queue import WaitingQueue


def queue_key(req: Request) -> tuple[int, float]:
    """Waiting order: priority (lower first), then arrival (FCFS)."""
    return (req.priority, req.arrival_time)


def choose_victim(running: list[Request]) -> Request:
    """Preempt the lowest-priority request, the latest arrival among equals."""
    return max(running, key=lambda r: (r.priority, r.arrival_time))


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self._waiting: WaitingQueue[Request] = WaitingQueue(queue_key)
        self._seen_by_runner: set[str] = set()
        self._finished_since_last_step: list[str] = []
        self.num_preemptions = 0

    # -- admission -------------------------------------------------------
    def check_admissible(self, req: Request) -> None:
        total = req.num_prompt_tokens + req.max_tokens
        if req.num_prompt_tokens == 0:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if total > self.config.max_model_len:
            param = "prompt" if req.num_prompt_tokens >= self.config.max_model_len else "max_tokens"
            raise InvalidRequestError(
                f"prompt ({req.num_prompt_tokens} tokens) plus max_tokens ({req.max_tokens}) is "
                f"{total} tokens, more than max_model_len ({self.config.max_model_len})",
                param, "context_length_exceeded",
            )
        if self.kv.blocks_needed(total) > self.kv.pool.num_blocks:
            prompt_alone = self.kv.blocks_needed(req.num_prompt_tokens) > self.kv.pool.num_blocks
            raise InvalidRequestError(
                f"request needs {self.kv.blocks_needed(total)} KV blocks but the whole cache has "
                f"{self.kv.pool.num_blocks}; raise kv_cache_memory or lower max_tokens",
                "prompt" if prompt_alone else "max_tokens", "context_length_exceeded",
            )

    def add_request(self, req: Request) -> None:
        self.check_admissible(req)
        self.requests[req.request_id] = req
        self._push_waiting(req)

    def _push_waiting(self, req: Request) -> None:
        self._waiting.push(req)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the step ----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        preempted = self._schedule_running(scheduled, budget)
        budget -= sum(scheduled.values())
        new_reqs: list[NewRequestData] = []
        if not preempted:
            self._schedule_waiting(scheduled, budget)
        out: list[ScheduledRequest] = []
        for req in self.running:
            n = scheduled.get(req.request_id)
            if n is None:
                continue
            if req.request_id not in self._seen_by_runner:
                self._seen_by_runner.add(req.request_id)
                new_reqs.append(self._new_request_data(req))
            out.append(
                ScheduledRequest(req.request_id, self.kv.block_ids(req.request_id), req.num_computed_tokens, n)
            )
        finished, self._finished_since_last_step = self._finished_since_last_step, []
        return SchedulerOutput(new_reqs, out, finished, preempted)

    def _schedule_running(self, scheduled: dict[str, int], budget: int) -> int:
        preempted = 0
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING or budget <= 0:
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, n):
                victim = choose_victim([r for r in self.running if r.status is RequestStatus.RUNNING])
                self._preempt(victim)
                budget += scheduled.pop(victim.request_id, 0)
                preempted += 1
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                scheduled[req.request_id] = n
                budget -= n
        return preempted

    def _schedule_waiting(self, scheduled: dict[str, int], budget: int) -> None:
        deferred: list[Request] = []
        while self._waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self._waiting.peek()
            if self._must_wait_for_sibling(req):
                deferred.append(self._waiting.pop())
                continue
            cached = self.kv.match_prefix(req)
            remaining = req.num_tokens - len(cached) * self.kv.block_size
            if not self.config.enable_chunked_prefill and remaining > budget:
                break
            n = min(remaining, budget)
            if not self.kv.allocate_slots(req, n, cached):
                break
            self._waiting.pop()
            if req.num_preemptions == 0:
                req.num_cached_prompt_tokens = len(cached) * self.kv.block_size
            req.num_computed_tokens = len(cached) * self.kv.block_size
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = n
            budget -= n
        for req in deferred:
            self._push_waiting(req)

    def _must_wait_for_sibling(self, req: Request) -> bool:
        """n > 1: siblings start once the first has computed the shared prompt,
        so they take its full prompt blocks from the prefix index."""
        sibling = self.requests.get(req.wait_for) if req.wait_for else None
        return sibling is not None and sibling.num_computed_tokens < sibling.num_prompt_tokens

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        self.running.remove(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(req)

    def _new_request_data(self, req: Request) -> NewRequestData:
        return NewRequestData(
            req.request_id, list(req.prompt_token_ids), req.sampling_params, req.eos_token_ids, req.seed_offset
        )

    # -- results -------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Advance progress, append sampled tokens, finish requests. Returns the
        requests that got a new token or finished this step."""
        touched: list[Request] = []
        for s in sched.scheduled:
            req = self.requests.get(s.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted meanwhile
            req.num_computed_tokens += s.num_scheduled_tokens
            self.kv.cache_computed_blocks(req)
            token = result.sampled.get(s.request_id)
            if token is None:
                continue
            req.append_token(token)
            status = req.check_stop()
            if status is not None:
                self.finish(req, status)
            touched.append(req)
        return touched

    def finish(self, req: Request, status: RequestStatus) -> None:
        if req.status.finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self._waiting.remove(req)  # O(1): lazy deletion
        req.status = status
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
        if req.request_id in self._seen_by_runner:
            self._seen_by_runner.discard(req.request_id)
            self._finished_since_last_step.append(req.request_id)

    def abort(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self.finish(req, RequestStatus.FINISHED_ABORTED)
