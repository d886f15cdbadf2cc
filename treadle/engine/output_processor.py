"""Turns scheduler progress into RequestOutputs: detokenization, stop strings,
logprobs, and gathering the n completions of one request."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from treadle.core.request import Request, RequestStatus
from treadle.core.step_data import ModelRunnerOutput, TokenLogprobs
from treadle.engine.detokenizer import IncrementalDetokenizer
from treadle.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from treadle.sampling_params import SamplingParams
from treadle.tokenizer import Tokenizer


@dataclass
class ChildState:
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_token_ids: list[int] = field(default_factory=list)


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: dict[str, ChildState]
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        """``tokenizer`` None (skip_tokenizer_init): outputs carry token ids and empty text."""
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.parent_of: dict[str, str] = {}  # child request id -> parent request id

    def add(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
            child_ids: list[str], arrival: float) -> None:
        children = {}
        for i, cid in enumerate(child_ids):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params)
            children[cid] = ChildState(i, detok, logprobs=[] if params.logprobs is not None else None,
                                       cumulative_logprob=0.0 if params.logprobs is not None else None)
            self.parent_of[cid] = request_id
        first: list[dict[int, Logprob] | None] | None = None if params.prompt_logprobs is None else [None]
        self.parents[request_id] = ParentState(request_id, prompt, prompt_ids, params, children,
                                               RequestMetrics(arrival), first)

    def _token_text(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.token_text(token_id)

    def _decoded(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        entries = {tid: Logprob(v, r + 1, self._token_text(tid)) for r, (tid, v) in enumerate(lp.top)}
        if lp.token_id not in entries:
            entries[lp.token_id] = Logprob(lp.logprob, lp.rank, self._token_text(lp.token_id))
        return entries

    def process(self, touched: list[Request], result: ModelRunnerOutput, stop_cb) -> list[str]:
        """Consume one step. ``stop_cb(request)`` finishes a request whose text hit a
        stop string. Returns the parent ids that have something new."""
        now = time.monotonic()
        updated: list[str] = []
        for rid, (pos, lps) in result.prompt_logprobs.items():
            parent = self.parents.get(self.parent_of.get(rid, ""))
            # n > 1: every child scores the same prompt; keep the first child's
            if parent is not None and parent.prompt_logprobs is not None and rid == next(iter(parent.children)):
                # by position: a preempted request computes its prompt again, and its first
                # chunks' entries are already here
                got = parent.prompt_logprobs
                got.extend(self._decoded(lp) for lp in lps[max(0, len(got) - pos):])
        for req in touched:
            pid = self.parent_of.get(req.request_id)
            if pid is None:
                continue
            parent, child = self.parents[pid], self.parents[pid].children[req.request_id]
            if parent.metrics.first_token_time is None:
                parent.metrics.first_token_time = now
                parent.metrics.num_cached_tokens = req.num_cached_prompt_tokens
            new_tokens = req.output_token_ids[len(req.output_token_ids) - req.num_new_tokens:]
            lps = result.logprobs.get(req.request_id) or []
            # a request that ended on a stop token (EOS, stop_token_ids) keeps it in token_ids, not in its text
            token_stop = req.status is RequestStatus.FINISHED_STOPPED and not isinstance(req.stop_reason, str)
            stop_token = new_tokens[-1] if token_stop and new_tokens and \
                not req.sampling_params.include_stop_str_in_output else None
            for i, token in enumerate(new_tokens):
                child.token_ids.append(token)
                child.new_token_ids.append(token)
                if i < len(lps) and child.logprobs is not None:
                    child.logprobs.append(self._decoded(lps[i]))
                    child.cumulative_logprob = (child.cumulative_logprob or 0.0) + lps[i].logprob
                if i == len(new_tokens) - 1 and token == stop_token:
                    break
                stop = child.detok.add_token(token)
                if stop is not None and not req.status.finished:
                    stop_cb(req)
                    req.stop_reason = stop
                    break  # later tokens of a verify step come after the stop string
            if req.status.finished:
                self.finish_child(req)
            if pid not in updated:
                updated.append(pid)
        return updated

    def finish_child(self, req: Request) -> None:
        pid = self.parent_of.get(req.request_id)
        if pid is None:
            return
        child = self.parents[pid].children[req.request_id]
        if child.finish_reason is None:
            child.finish_reason = req.status.value if req.status.finished else RequestStatus.FINISHED_ABORTED.value
            child.stop_reason = req.stop_reason
            if req.kv_transfer_params is not None:
                self.parents[pid].kv_transfer_params = req.kv_transfer_params
            self.parents[pid].metrics.num_preemptions += req.num_preemptions

    def make_output(self, pid: str) -> RequestOutput:
        parent = self.parents[pid]
        finished = parent.finished
        outputs = []
        for c in parent.children.values():
            delta = c.detok.take_delta(c.finish_reason is not None)
            outputs.append(CompletionOutput(
                index=c.index, text=c.detok.text, token_ids=list(c.token_ids),
                cumulative_logprob=c.cumulative_logprob, logprobs=c.logprobs,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                new_text=delta, new_token_ids=c.new_token_ids,
            ))
            c.new_token_ids = []
        if finished:
            parent.metrics.finished_time = time.monotonic()
            for cid in parent.children:
                self.parent_of.pop(cid, None)
            del self.parents[pid]
        return RequestOutput(pid, parent.prompt, parent.prompt_token_ids, outputs, finished,
                             parent.prompt_logprobs, parent.metrics, parent.kv_transfer_params)
