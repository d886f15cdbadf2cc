"""A request as the LLM Manager sees it: token ids, progress, and status."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from treadle.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # P/D consumer: blocks allocated, KV being pulled
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: never None here
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = 0.0
    priority: int = 0  # lower value is served first (as in vLLM)
    wait_for: str | None = None  # n > 1: a sibling whose prompt KV this one will reuse
    seed_offset: int = 0  # n > 1: child i samples with seed + i
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prefix-cache hit on first admission
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    spec_token_ids: list[int] = field(default_factory=list)  # drafts proposed for the next step
    num_new_tokens: int = 0  # tokens appended by the last step (1, or more with speculation)
    kv_transfer_params: dict[str, Any] | None = None  # P/D producer: where a consumer pulls this KV
    predicted_output_tokens: int | None = None  # the length predictor's guess at admission (cost_policy.py)
    num_passed_over: int = 0  # predicted: later arrivals admitted while this one waited (cost_policy.py)

    @property
    def num_drafts_allowed(self) -> int:
        """Most drafts the next step may verify: output left after one sure token."""
        return max(0, self.max_tokens - len(self.output_token_ids) - 1)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def check_stop(self) -> RequestStatus | None:
        """Token-level stopping (stop strings are the detokenizer's business)."""
        n_out = len(self.output_token_ids)
        if n_out == 0:
            return None
        last = self.output_token_ids[-1]
        params = self.sampling_params
        if n_out >= params.min_tokens:
            if (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids:
                self.stop_reason = last if last in params.stop_token_ids else None  # EOS: None, as vLLM
                return RequestStatus.FINISHED_STOPPED
        if n_out >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
