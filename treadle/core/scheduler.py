"""The LLM Manager's scheduler: one token-budgeted rule, no phases.

Each request has ``num_computed_tokens`` and a target ``num_tokens`` (prompt +
generated). A step hands out ``max_num_batched_tokens``: running requests
first (decodes, or the rest of a chunked prompt), then chunks of waiting
prompts. Chunked prefill (SplitFuse), prefix-cache hits and preemption by
recompute all fall out of that rule; the policy pieces (queue order, victim
choice) live in ``core/cost_policy.py``.

Speculative decoding reserves lookahead slots only: a running request's target is its
tokens plus the drafts the runner proposed last step (``Request.spec_token_ids``, when the
fallback controller lets them run), so its 1 + K tokens share the step's budget with prompt
chunks; on the way back rejected drafts wind ``num_computed_tokens`` back and the blocks that
held only them are freed (``KVCacheManager.trim``).

Batch queue (pipeline parallelism): with ``max_batches`` = P > 1 the engine keeps up to P
steps in flight. A request is in at most one of them (it is skipped, and never preempted,
while its step is out), each step takes about 1/P of the live requests so the stages get
equal batches, and a request finished or aborted meanwhile keeps its blocks until its step
comes back (the workers may still be writing them).
"""
from __future__ import annotations

from collections.abc import Iterable

from treadle.config import InvalidRequestError, SchedulerConfig
from treadle.core.cost_policy import PassOverCount, SchedulingPolicy
from treadle.core.kv_cache_manager import KVCacheManager
from treadle.core.kv_connector_data import KVConnectorMetadata
from treadle.core.request import Request, RequestStatus
from treadle.core.spec_fallback import FallbackController
from treadle.core.step_data import ModelRunnerOutput, NewRequestData, ScheduledRequest, SchedulerOutput
from treadle.core.waiting_queue import WaitingQueue


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 spec: FallbackController | None = None, max_batches: int = 1,
                 send_token_ids: bool = False, lookahead_slots: int = 0) -> None:
        """``spec``: speculation is configured (drafts returned by the runner are scheduled
        where it allows); None: drafts are never scheduled. ``max_batches``: steps the engine
        keeps in flight. ``send_token_ids``: each scheduled request carries the output tokens
        the workers have not seen (pipeline parallelism; see ScheduledRequest).
        ``lookahead_slots``: KV slots reserved past each scheduled chunk for a proposer's own
        KV (``SpeculativeConfig``)."""
        self.config = config
        self.kv = kv
        self.spec = spec
        self.lookahead_slots = lookahead_slots
        self.max_batches = max_batches
        self.send_token_ids = send_token_ids
        self._in_flight: set[str] = set()  # requests in a step that has not come back
        self._free_on_return: dict[str, Request] = {}  # finished while in flight: free when it returns
        self._tokens_sent: dict[str, int] = {}  # output tokens the workers have, per request
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self.policy = SchedulingPolicy.from_config(config)  # waiting order, victim choice
        self._waiting: WaitingQueue[Request] = WaitingQueue(self.policy.queue_key)
        self._passes = PassOverCount(self.policy.max_passed_over) if self.policy.counts_passes else None
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
        chunk = self.config.max_num_batched_tokens
        need = self.kv.peak_blocks(total, chunk)
        if need > self.kv.pool.num_blocks:
            prompt_alone = self.kv.peak_blocks(req.num_prompt_tokens, chunk) > self.kv.pool.num_blocks
            raise InvalidRequestError(
                f"request needs {need} KV blocks but the whole cache has "
                f"{self.kv.pool.num_blocks}; raise kv_cache_memory or lower max_tokens",
                "prompt" if prompt_alone else "max_tokens", "context_length_exceeded",
            )

    def add_request(self, req: Request) -> None:
        self.check_admissible(req)
        self.requests[req.request_id] = req
        self._push_waiting(req)

    def _push_waiting(self, req: Request) -> None:
        self._waiting.push(req)
        if self._passes is not None:
            self._passes.add(req)

    def _pop_waiting(self) -> Request:
        req = self._waiting.pop()
        if self._passes is not None:
            self._passes.discard(req)
        return req

    def _admitted(self, req: Request) -> None:
        """``req`` left the queue to run: count whom it passed over; re-queue those now overdue
        (their key puts them first, ``SchedulingPolicy.overdue``)."""
        if self._passes is None:
            return
        for older in self._passes.admitted(req):
            self._waiting.remove(older)
            self._waiting.push(older)

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
        self._gate_drafts()
        max_reqs = self._batch_share()
        preempted = self._schedule_running(scheduled, budget, max_reqs)
        budget -= sum(scheduled.values())
        new_reqs: list[NewRequestData] = []
        if not preempted:
            self._schedule_waiting(scheduled, budget, max_reqs)
        out: list[ScheduledRequest] = []
        for req in self.running:
            n = scheduled.get(req.request_id)
            if n is None:
                continue
            if req.request_id not in self._seen_by_runner:
                self._seen_by_runner.add(req.request_id)
                new_reqs.append(self._new_request_data(req))
            drafts = req.spec_token_ids[: max(0, req.num_computed_tokens + n - req.num_tokens)]
            propose = self.spec is not None and self.spec.will_speculate(req.request_id, len(self.running))
            out.append(ScheduledRequest(req.request_id, self.kv.block_ids(req.request_id),
                                        req.num_computed_tokens, n, drafts, self._unsent_tokens(req), propose,
                                        self.kv.group_block_ids(req.request_id)))
            self._in_flight.add(req.request_id)
        finished, self._finished_since_last_step = self._finished_since_last_step, []
        return SchedulerOutput(new_reqs, out, finished, preempted, self._connector_metadata())

    def _batch_share(self) -> int:
        """Most requests one step may take: all with one step in flight, else 1/P of the live
        ones (rounded up), so P steps in flight carry equal batches."""
        if self.max_batches == 1:
            return self.config.max_num_seqs
        live = len(self.running) + len(self._waiting)
        return max(1, -(-live // self.max_batches))

    def _unsent_tokens(self, req: Request) -> list[int]:
        if not self.send_token_ids:
            return []
        sent = self._tokens_sent.get(req.request_id, 0)
        self._tokens_sent[req.request_id] = len(req.output_token_ids)
        return req.output_token_ids[sent:]

    def _schedule_running(self, scheduled: dict[str, int], budget: int, max_reqs: int) -> int:
        preempted = 0
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING or budget <= 0 or len(scheduled) >= max_reqs:
                continue
            if req.request_id in self._in_flight:
                continue
            n = min(req.num_tokens + len(req.spec_token_ids) - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, n + self._lookahead(req, n)):
                victims = [r for r in self.running
                           if r.status is RequestStatus.RUNNING and r.request_id not in self._in_flight]
                if not victims:  # every other request is in a step in flight: wait for one
                    break
                victim = self.policy.choose_victim(victims)
                self._preempt(victim)
                budget += scheduled.pop(victim.request_id, 0)
                preempted += 1
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                scheduled[req.request_id] = n
                budget -= n
        return preempted

    def _lookahead(self, req: Request, n: int) -> int:
        """Slots past the ``n`` scheduled ones, never past the request's last possible token."""
        end = req.num_computed_tokens + n
        return max(0, min(self.lookahead_slots, req.num_prompt_tokens + req.max_tokens - end))

    def _gate_drafts(self) -> None:
        """Keep the drafts only where the fallback controller says speculation pays."""
        if self.spec is None:
            return
        with_drafts = [r for r in self.running if r.spec_token_ids]
        admits = bool(self._waiting) and len(self.running) < self.config.max_num_seqs
        with_prompt = admits or any(r.num_tokens - r.num_computed_tokens > 1 for r in self.running)
        # called every step: probes come due even while the runner drafts for nobody (``propose``)
        if not self.spec.speculate_batch(len(self.running), bool(with_drafts), with_prompt):
            for req in with_drafts:
                req.spec_token_ids = []
            return
        for req in with_drafts:
            if not self.spec.speculate_request(req.request_id):
                req.spec_token_ids = []

    def _schedule_waiting(self, scheduled: dict[str, int], budget: int, max_reqs: int) -> None:
        deferred: list[Request] = []
        while (self._waiting and budget > 0 and len(self.running) < self.config.max_num_seqs
               and len(scheduled) < max_reqs):
            req = self._waiting.peek()
            if self._must_wait_for_sibling(req):
                deferred.append(self._pop_waiting())
                continue
            remote = self._start_remote_load(req)
            if remote is not None:
                if not remote:
                    break
                if req.status is RequestStatus.RUNNING:  # layer-wise start: runs now, its KV arriving
                    scheduled[req.request_id] = n = min(req.num_tokens - req.num_computed_tokens, budget)
                    budget -= n
                continue
            cached = self.kv.match_prefix(req)
            num_cached = cached.num_blocks * self.kv.block_size
            remaining = req.num_tokens - num_cached
            if not self.config.enable_chunked_prefill and remaining > budget:
                break
            n = min(remaining, budget)
            if not self.kv.allocate_slots(req, n + self._lookahead(req, num_cached + n), cached):
                break
            self._waiting.pop()
            self._admitted(req)
            if req.num_preemptions == 0:
                req.num_cached_prompt_tokens = num_cached
            req.num_computed_tokens = num_cached
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
        self.kv.free(req)  # the workers keep its tokens (``_tokens_sent`` stays)
        self.running.remove(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(req)

    def _new_request_data(self, req: Request) -> NewRequestData:
        return NewRequestData(
            req.request_id, list(req.prompt_token_ids), req.sampling_params, req.eos_token_ids, req.seed_offset
        )

    # -- results -------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Advance progress, append sampled tokens (accepted drafts first), roll back rejected
        drafts, finish requests. Returns the requests that got new tokens or finished."""
        self.step_returned(sched)
        touched: list[Request] = []
        self._on_connector_output(result)
        for s in sched.scheduled:
            req = self.requests.get(s.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted meanwhile
            tokens = result.sampled.get(s.request_id)
            if tokens is None:
                req.num_computed_tokens += s.num_scheduled_tokens
                self.kv.on_tokens_computed(req)
                continue
            num_rejected = len(s.draft_token_ids) - (len(tokens) - 1)
            req.num_computed_tokens += s.num_scheduled_tokens - num_rejected
            req.spec_token_ids = []
            if s.draft_token_ids:
                self._observe_verify(req, len(s.draft_token_ids), len(tokens) - 1)
            req.num_new_tokens = self._append_tokens(req, tokens)
            if req.status.finished:
                touched.append(req)
                continue
            if num_rejected:
                self.kv.trim(req)
            self.kv.on_tokens_computed(req)
            req.spec_token_ids = result.draft_token_ids.get(req.request_id, [])[: self._max_drafts(req)]
            touched.append(req)
        return touched

    def step_returned(self, sched: SchedulerOutput) -> None:
        """``sched``'s step is back (or failed): its requests may be scheduled again, and the
        blocks of those finished meanwhile are freed. Idempotent."""
        for s in sched.scheduled:
            self._in_flight.discard(s.request_id)
            gone = self._free_on_return.pop(s.request_id, None)
            if gone is not None:
                self.kv.free(gone)

    def _append_tokens(self, req: Request, tokens: list[int]) -> int:
        """Append until a token stops the request; returns how many were appended."""
        for i, token in enumerate(tokens):
            req.append_token(token)
            status = req.check_stop()
            if status is not None:
                self.finish(req, status)
                return i + 1
        return len(tokens)

    def _max_drafts(self, req: Request) -> int:
        if self.spec is None:
            return 0
        return min(req.num_drafts_allowed, self.config.max_model_len - req.num_tokens)

    def _observe_verify(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        if self.spec is not None:
            self.spec.stats.record_verify(num_drafts, num_accepted)
            self.spec.observe_verify(req.request_id, len(self.running), num_accepted)

    def finish(self, req: Request, status: RequestStatus) -> None:
        if req.status.finished:
            return
        old_status = req.status
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self._waiting.remove(req)  # O(1): lazy deletion
            if self._passes is not None:
                self._passes.discard(req)
        req.status = status
        req.spec_token_ids = []
        if self.spec is not None:
            self.spec.forget(req.request_id)
        self._tokens_sent.pop(req.request_id, None)
        self._release_blocks(req, old_status)
        self.requests.pop(req.request_id, None)
        if req.request_id in self._seen_by_runner:
            self._seen_by_runner.discard(req.request_id)
            self._finished_since_last_step.append(req.request_id)

    # -- hooks of a KV connector (kv_transfer/scheduler.py); without one, plain local compute ----
    def _start_remote_load(self, req: Request) -> bool | None:
        """None: ``req`` (at the head of the queue) computes its prompt here; True: it was taken
        off the queue to wait for remote KV (or, RUNNING, to run in this step while its KV
        arrives layer by layer); False: it must wait (no blocks yet)."""
        return None

    def _connector_metadata(self) -> KVConnectorMetadata | None:
        """What the workers' connector must do before this step runs."""
        return None

    def _on_connector_output(self, result: ModelRunnerOutput) -> None:
        """Transfers the workers finished (or failed) since the last step."""

    def _release_blocks(self, req: Request, old_status: RequestStatus) -> None:
        """``req`` finished (``old_status``: what it was doing): give its blocks back."""
        if req.request_id in self._in_flight:
            self._free_on_return[req.request_id] = req  # its step may still be writing the blocks
        else:
            self.kv.free(req)

    def has_pending_transfers(self) -> bool:
        """KV transfers in flight or blocks held for a remote consumer: keep stepping."""
        return False

    def abort(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self.finish(req, RequestStatus.FINISHED_ABORTED)
