"""Plain data crossing the scheduler <-> model runner boundary (no tensors).

These are exactly what a multi-process executor or a prefill/decode split
would send over the wire.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from treadle.core.kv_connector_data import KVConnectorMetadata, KVConnectorOutput
from treadle.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """Sent the first time the runner sees a request."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    seed_offset: int = 0  # n > 1: child i samples with seed + i


@dataclass
class ScheduledRequest:
    """One request's share of this step: compute tokens
    [num_computed_tokens, num_computed_tokens + num_scheduled_tokens). With speculation the
    last ``len(draft_token_ids)`` of them are drafts to verify (lookahead slots)."""

    request_id: str
    block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int  # drafts included
    draft_token_ids: list[int] = field(default_factory=list)
    # pipeline parallelism: output tokens sampled since the workers last saw this request (the
    # sampling rank is the last stage; the others learn the tokens here, not by a collective
    # that would hold every stage to the slowest step)
    new_token_ids: list[int] = field(default_factory=list)
    propose: bool = True  # the runner drafts for the next step (False: the fallback would drop them)
    # hybrid KV (core/kv_groups.py): the tables of KV groups 1.. (``block_ids`` is group 0's); empty: one group
    group_block_ids: list[list[int]] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData]
    scheduled: list[ScheduledRequest]  # batch order
    finished_request_ids: list[str]  # the runner may drop their state
    num_preemptions: int = 0
    kv_connector_metadata: KVConnectorMetadata | None = None  # P/D: transfers to start or serve

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class TokenLogprobs:
    """Log-probabilities at one position: the chosen token and the top-n."""

    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass
class ModelRunnerOutput:
    # request id -> new tokens (only requests that reached their end): one token, or with
    # speculation the accepted drafts then the correction / bonus token
    sampled: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # per sampled token
    # this step's chunk: (prompt position its first entry scores, one entry per position)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # proposals for the next step
    kv_connector_output: KVConnectorOutput | None = None  # P/D: transfers that ended
