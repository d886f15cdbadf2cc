"""The proposer contract: after the target's step the runner hands every proposer the same
view of that step, and gets drafts back for the next one.

    target step t (flat batch, rows in batch order)
        request r:  rows [flat_start, flat_start + n)  positions [start, start + n)
                    after verification the first ``num_verified`` of them hold final tokens
                    (real tokens + accepted drafts); the target's KV is valid for them
    propose(step)   -> {request id: drafts d1..dk}  (k <= K), for requests with wants_drafts

Draft KV (a proposer that owns a small model: a draft model, an EAGLE head) lives in the
**same block pool** as the target's: its own per-layer tensors, indexed by the same physical
block ids and slot mapping (``RequestProgress.block_ids``). So allocation, prefix caching,
rollback (``KVCacheManager.trim``) and preemption need no second allocator. The invariant a
KV-owning proposer keeps: its KV is valid for every position the target has computed, i.e.
each step it runs on the request's verified positions ``[start, start + num_verified)`` (prompt
chunks too), so a full cached block carries the proposer's KV as well and a prefix hit needs
no catch-up. Positions at or past the target's computed length are scratch: the proposer may
write them while drafting (the scheduler reserves ``SpeculativeConfig.lookahead_slots`` slots
past each scheduled chunk for that) but must never read them in a later step. A request whose
``start`` went backwards was preempted (recomputed) or rolled back: nothing to do for KV.

Drafts here are deterministic functions of the context (argmax of the draft; n-gram lookup):
the verifier treats them as a point mass, which is exact for sampling too and keeps a seeded
request's tokens equal with and without speculation. A proposer that samples its drafts
returns q through ``draft_probs``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass
class RequestProgress:
    """One scheduled request's part of the target's step, after verification."""

    request_id: str
    token_ids: list[int]  # prompt + output, this step's new tokens included
    block_ids: list[int]  # physical blocks (the target's; a draft's KV uses the same ids)
    start: int  # first position the target computed this step
    num_verified: int  # positions [start, start + num_verified) hold final tokens now
    flat_start: int  # their rows in the step's flat batch: [flat_start, flat_start + num_verified)
    wants_drafts: bool  # got new tokens this step and may speculate next step
    num_slots: int  # positions with an allocated KV slot: drafting writes only below it
    num_drafts: int = 0  # drafts verified this step (0: a plain decode or a prompt chunk)
    num_accepted: int = 0  # of them accepted


@dataclass
class ProposerStep:
    requests: list[RequestProgress]  # batch order; every scheduled request of the step
    hidden: torch.Tensor | None  # [num_tokens, hidden_size] the target's final hidden states (after
    # its final norm) over the step's flat batch; a request's verified rows are
    # hidden[flat_start : flat_start + num_verified]. None on a rank that does not sample.


class Proposer(ABC):
    """Drafts K tokens per request. Built once per worker (``spec_decode.build_proposer``)."""

    # True: the proposer keeps state (draft KV) over every verified position, so it sees every
    # step; False: the runner skips ``propose`` on steps where no request wants drafts.
    owns_kv: bool = False

    def __init__(self, num_speculative_tokens: int) -> None:
        self.k = num_speculative_tokens

    @abstractmethod
    def propose(self, step: ProposerStep) -> dict[str, list[int]]:
        """Called after every target step with every scheduled request (prompt chunks and
        requests that will not draft included, so a KV-owning proposer catches up on them).
        Returns up to K drafts for each request with ``wants_drafts`` (missing or [] means
        none); the scheduler may cut them (max tokens, model length, fallback)."""

    def draft_probs(self, request_id: str, num_drafts: int) -> torch.Tensor | None:  # [num_drafts, V]
        """q of the drafts last proposed for the request, for the rejection sampler; None (the
        default) when the drafts are a deterministic function of the context (a point mass)."""
        return None

    def finish(self, request_ids: Iterable[str]) -> None:  # noqa: B027 - optional hook
        """The requests finished or were aborted: drop any per-request state (KV needs nothing:
        their blocks go back to the pool with the target's)."""


class DraftLength:
    """Per request, how many drafts to propose next (1..K), from its last verify: after all d
    drafts were accepted, 2d (at most K); after a rejection at position a + 1, a + 1 (the
    drafts past the first rejection were rows the target computed for nothing). A verify row
    costs a sizeable part of a plain step on a compute-bound CPU, so long chains pay only while
    they are accepted (grounded text: long runs copied from the prompt, short ones after edits)."""

    def __init__(self, k: int, start: int = 4) -> None:
        self.k, self.start = k, min(k, start)
        self._next: dict[str, int] = {}

    def of(self, r: RequestProgress) -> int:
        """The draft count for ``r``'s next step, updated by this step's verify (if any)."""
        n = self._next.get(r.request_id, self.start)
        if r.num_drafts:
            n = min(self.k, 2 * r.num_drafts) if r.num_accepted == r.num_drafts else r.num_accepted + 1
            self._next[r.request_id] = n
        return n

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._next.pop(rid, None)
