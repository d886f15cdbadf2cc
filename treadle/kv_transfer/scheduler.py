"""The scheduler side of the KV connector (torch-free): a Scheduler whose hooks know remote KV.

Consumer (``do_remote_prefill``): a waiting request whose producer holds its prompt's KV gets
blocks for its whole prompt, leaves the queue in ``WAITING_FOR_REMOTE_KV``, and its LoadSpec
goes to the workers. The remote tokens are the prompt less its last token: the consumer
computes that one token itself, which yields the logits of the first output token, so the
first token comes out of the consumer's own sampler (identical to the producer's under
greedy or seeded sampling) and the one scheduling rule is untouched. When the workers report
the load done, ``num_computed_tokens`` jumps to the remote count and the request runs; when
they report it failed (unreachable, timeout, corrupt, shape), it runs from 0: the prompt is
recomputed here (``recomputes``). A request finished while loading keeps its blocks until the
workers report the transfer over, so no block is reused under a write.

Layer-wise start (``layerwise_start``, the default): the request does not wait for the whole
load. As soon as the workers report it ``started`` (the producer answered the pull and layers
are on the wire) it goes back to the waiting queue, and runs in the next step that takes it
with ``num_computed_tokens`` = the remote count, its id in the metadata's ``streaming``: the
model waits for each layer of its KV before running that layer. (Started, not merely asked
for: a pull still parked at a busy producer would stall every request of the step.) If the
load fails during that step, the workers stop the pull before the step returns and report it
failed: the request's step output is discarded and it recomputes its prompt as a preempted
request does (counted in ``recomputes`` and in the scheduler's preemptions; the runner is told
to drop its copy, which holds the discarded token). A request that will not
pull the KV its producer holds (aborted before its load finished, a failed load, a length
mismatch) sends that producer a release (``remote_releases``; the workers also cancel a pull
in flight), so the producer frees the blocks at once instead of at its timeout.

Producer (``do_remote_decode``, n == 1): when the request finishes (normally after its one
token) its blocks are held, not freed; ``kv_transfer_params`` naming them (and this instance's
``remote_tp_size``) goes out with the final output; the workers serve them until a consumer
pulls them (``finished_sending`` frees them), a consumer or the router releases them
(``released_unpulled`` frees them: the client left between prefill and decode), or
``producer_block_timeout_s`` passes (the workers are told to stop serving first).

Under tensor parallelism the reports read here are the instance's, merged by the executor from
every rank's (``aggregate.py``): a load started or finished on all ranks, failed once all ended
it and one failed, held blocks sent (or released) by all ranks.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from treadle.config import KVTransferConfig, SchedulerConfig
from treadle.core.kv_cache_manager import KVCacheManager
from treadle.core.kv_connector_data import (
    KVConnectorMetadata,
    LoadSpec,
    RemotePrefill,
    RemoteRelease,
    wants_remote_decode,
)
from treadle.core.request import Request, RequestStatus
from treadle.core.scheduler import Scheduler
from treadle.core.spec_fallback import FallbackController
from treadle.core.step_data import ModelRunnerOutput

logger = logging.getLogger("treadle")
STREAMING, LOADED, FAILED = "streaming", "loaded", "failed"  # a started load, layer-wise start


@dataclass
class KVTransferStats:
    role: str
    num_loads: int = 0  # consumer: prompts whose KV arrived
    num_recomputes: int = 0  # consumer: transfers that failed, so the prompt was computed here
    num_bytes_received: int = 0
    num_pulled: int = 0  # producer: held KV a consumer took
    num_expired: int = 0  # producer: held KV freed after producer_block_timeout_s
    num_released: int = 0  # producer: held KV freed unpulled because a consumer or the router let it go
    num_held: int = 0  # producer: requests whose blocks are held now (gauge)
    num_loading: int = 0  # consumer: requests waiting for their KV now (gauge)

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


class KVTransferScheduler(Scheduler):
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, spec: FallbackController | None,
                 kv_transfer: KVTransferConfig, clock: Callable[[], float] = time.monotonic,
                 max_batches: int = 1, send_token_ids: bool = False, lookahead_slots: int = 0,
                 tp_size: int = 1) -> None:
        super().__init__(config, kv, spec, max_batches, send_token_ids, lookahead_slots)
        self.kv_transfer = kv_transfer
        self.tp_size = tp_size  # this instance's tensor-parallel size: producers name it in kv_transfer_params
        self._clock = clock
        self._loading: dict[str, tuple[Request, int]] = {}  # consumer: id -> (request, remote tokens)
        self._orphans: dict[str, Request] = {}  # finished while loading: freed once the workers are done
        self._streaming: set[str] = set()  # layer-wise start: running while their load is not reported over
        self._started: dict[str, str] = {}  # layer-wise start, queued to run: id -> STREAMING | LOADED | FAILED
        self._held: dict[str, tuple[Request, float]] = {}  # producer: id -> (request, deadline)
        self._meta = KVConnectorMetadata()
        self.kv_stats = KVTransferStats(kv_transfer.role)

    # -- consumer ----------------------------------------------------------------------------
    def _start_remote_load(self, req: Request) -> bool | None:
        if req.request_id in self._started:
            return self._run_started(req)
        remote = RemotePrefill.parse(req.sampling_params.kv_transfer_params)
        if remote is None or not self.kv_transfer.is_consumer or req.num_preemptions:
            return None
        if remote.num_tokens != req.num_prompt_tokens:
            logger.warning("request %s: the producer holds %d prompt tokens, the prompt has %d; recomputing",
                           req.request_id, remote.num_tokens, req.num_prompt_tokens)
            self.kv_stats.num_recomputes += 1
            self._release_remote(req.request_id, remote)
            return None
        num_remote = req.num_prompt_tokens - 1  # the last prompt token is computed here (first token)
        if num_remote < 1:
            return None
        if not self.kv.allocate_slots(req, req.num_prompt_tokens):
            return False
        self._pop_waiting()
        self._loading[req.request_id] = (req, num_remote)
        blocks = self.kv.block_ids(req.request_id)[: self.kv.blocks_needed(num_remote)]
        self._meta.loads.append(LoadSpec(req.request_id, remote.request_id, remote.host, remote.port,
                                         num_remote, blocks, remote.tp_size))
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        return True

    def _load_started(self, rid: str) -> None:
        """Layer-wise start: the producer is sending; the request queues to run while layers land."""
        entry = self._loading.get(rid)
        if not self.kv_transfer.layerwise_start or entry is None or \
                entry[0].status is not RequestStatus.WAITING_FOR_REMOTE_KV:
            return
        entry[0].status = RequestStatus.WAITING
        self._started[rid] = STREAMING
        self._push_waiting(entry[0])

    def _run_started(self, req: Request) -> bool:
        """A started request at the head of the queue runs in this step (the base schedules it):
        streaming (the model waits for each layer), or with its load already over."""
        rid = req.request_id
        state = self._started.pop(rid)
        self._pop_waiting()
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        req.num_computed_tokens = 0 if state == FAILED else req.num_prompt_tokens - 1
        if state == STREAMING:
            self._streaming.add(rid)
            self._meta.streaming.append(rid)
        elif state == LOADED:
            self.kv.cache_computed_blocks(req)
        return True

    def _on_connector_output(self, result: ModelRunnerOutput) -> None:
        out = result.kv_connector_output
        if out is None:
            return
        self.kv_stats.num_bytes_received += out.num_bytes_received
        for rid in out.started_loading:
            if rid not in out.failed_loading and rid not in out.finished_loading:
                self._load_started(rid)
        for rid in out.finished_loading:
            self._load_ended(rid, None)
        for rid, why in out.failed_loading.items():
            self._load_ended(rid, why)
        for rid in out.finished_sending:
            if self._free_held(rid):
                self.kv_stats.num_pulled += 1
        for rid in out.released_unpulled:
            if self._free_held(rid):
                self.kv_stats.num_released += 1

    def _load_ended(self, rid: str, failure: str | None) -> None:
        orphan = self._orphans.pop(rid, None)
        if orphan is not None:
            self.kv.free(orphan)
            self.kv_stats.num_loads += failure is None
            return
        entry = self._loading.pop(rid, None)
        if entry is None:
            return
        req, num_remote = entry
        if rid in self._streaming:
            self._streamed_load_ended(req, failure)
            return
        if failure is None:
            self.kv_stats.num_loads += 1
        else:
            logger.warning("request %s: KV transfer failed (%s); recomputing the prompt", rid, failure)
            self.kv_stats.num_recomputes += 1
            self._release_remote(rid, RemotePrefill.parse(req.sampling_params.kv_transfer_params))
        if rid in self._started:  # queued to run: it runs with its load over
            self._started[rid] = LOADED if failure is None else FAILED
            return
        if failure is None:
            req.num_computed_tokens = num_remote
            self.kv.cache_computed_blocks(req)
        else:
            req.num_computed_tokens = 0
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _streamed_load_ended(self, req: Request, failure: str | None) -> None:
        """Layer-wise start: the request has run (its step waited for every layer); on a failure
        that step's output is discarded and the prompt recomputed."""
        rid = req.request_id
        self._streaming.discard(rid)
        if failure is None:
            self.kv_stats.num_loads += 1
            return
        logger.warning("request %s: KV transfer failed during its step (%s); recomputing the prompt", rid, failure)
        self.kv_stats.num_recomputes += 1
        self._release_remote(rid, RemotePrefill.parse(req.sampling_params.kv_transfer_params))
        if req.status is RequestStatus.RUNNING:
            self._preempt(req)  # frees its blocks (no pull writes them any more); the update skips it
            self._seen_by_runner.discard(rid)  # the runner drops its copy, which holds the discarded token
            self._finished_since_last_step.append(rid)

    # -- producer ----------------------------------------------------------------------------
    def _free_held(self, rid: str) -> bool:
        held = self._held.pop(rid, None)
        if held is None:
            return False
        self.kv.free(held[0])
        return True

    def _release_remote(self, rid: str, remote: RemotePrefill | None) -> None:
        """The producer of ``remote`` may free what it holds for ``rid``: it will not be pulled."""
        if remote is not None and self.kv_transfer.is_consumer:
            self._meta.remote_releases.append(RemoteRelease(rid, remote.request_id, remote.host, remote.port,
                                                             remote.tp_size))

    def _release_blocks(self, req: Request, old_status: RequestStatus) -> None:
        rid = req.request_id
        if rid in self._loading:  # waiting for or receiving its KV
            del self._loading[rid]
            self._streaming.discard(rid)
            self._started.pop(rid, None)
            self._orphans[rid] = req  # the workers may still be writing its blocks
            self._release_remote(rid, RemotePrefill.parse(req.sampling_params.kv_transfer_params))
            return
        started = self._started.pop(rid, None) is not None  # queued to run, its load over
        if old_status is RequestStatus.WAITING and not req.num_preemptions and not started:  # load never started
            self._release_remote(rid, RemotePrefill.parse(req.sampling_params.kv_transfer_params))
        params = req.sampling_params
        if (self.kv_transfer.is_producer and wants_remote_decode(params.kv_transfer_params) and params.n == 1
                and req.status is not RequestStatus.FINISHED_ABORTED
                and req.num_computed_tokens >= req.num_prompt_tokens):
            self._hold(req)
            return
        super()._release_blocks(req, old_status)

    def _hold(self, req: Request) -> None:
        rid, cfg = req.request_id, self.kv_transfer
        block_ids = self.kv.block_ids(rid)
        self._held[rid] = (req, self._clock() + cfg.producer_block_timeout_s)
        self._meta.saves[rid] = block_ids
        req.kv_transfer_params = {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": cfg.engine_id,
            "remote_host": cfg.ip, "remote_port": cfg.port, "remote_tp_size": self.tp_size, "remote_request_id": rid,
            "remote_block_ids": block_ids, "num_tokens": req.num_prompt_tokens,
            "first_token_id": req.output_token_ids[0] if req.output_token_ids else None,
        }

    def _connector_metadata(self) -> KVConnectorMetadata | None:
        now = self._clock()
        for rid, (req, deadline) in list(self._held.items()):
            if deadline <= now:  # nobody pulled: stop serving (the workers first), then free
                del self._held[rid]
                self._meta.releases.append(rid)
                self._meta.saves.pop(rid, None)
                self.kv.free(req)
                self.kv_stats.num_expired += 1
                logger.warning("request %s: nobody pulled its KV in %.1f s; blocks freed", rid,
                               self.kv_transfer.producer_block_timeout_s)
        meta, self._meta = self._meta, KVConnectorMetadata()
        return None if meta.is_empty else meta

    def has_pending_transfers(self) -> bool:
        return bool(self._held or self._loading or self._orphans or not self._meta.is_empty)

    def stats(self) -> dict[str, Any]:
        self.kv_stats.num_held = len(self._held)
        self.kv_stats.num_loading = len(self._loading)
        return self.kv_stats.as_dict()
