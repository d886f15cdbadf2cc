"""The proposer contract: after the target's step the runner hands every proposer the same
view of that step, and gets drafts back for the next one.

    target step t (flat batch, rows in batch order)
        request r:  rows [flat_start, flat_start + n)  positions [start, start + n)
                    after verification the first ``num_verified`` of them hold final tokens
                    (real tokens + accepted drafts); the target's KV is valid for them
    propose(step)   -> {request id: drafts d1..dk}  (k <= K), for requests with wants_drafts

Draft KV (a proposer that owns a small model: a draft model, an EAGLE head) lives in the
**same block pool** as the target's: its own per-layer tensors, indexed by the same physical
block ids and slot mapping (``RequestProgress.block_ids``). So allocation, rollback
(``KVCacheManager.trim``) and preemption need no second allocator. A KV-owning proposer sees
every step but runs its model only for the requests that draft in it (lazy catch-up,
``CatchUp``): per request its KV is valid on positions [0, valid), valid <= the target's
computed length, and a drafting request first runs [valid, verified end) in the step's one
flat catch-up forward. A request that does not draft (fallback switched it or the batch off,
a prompt chunk, a grammar) costs the proposer bookkeeping only, however many steps it stays
off; the next draft pays for all of them in one forward (many rows in one call cost less per
row than one call per step).

    request r, its proposer KV:  [0, valid) valid | [valid, computed) missed while not drafting
    r drafts this step:          catch-up [valid, verified end) -> valid = verified end -> drafts

valid starts at 0 for a request the proposer has not seen, a prefix hit included (a cached
block may have been computed by a request that never drafted, so its proposer KV may be
missing: the first catch-up recomputes it over the hit), and goes back to 0 when the target
recomputes (a step whose ``start`` is below the computed length last seen: preemption).
Positions at or past valid are scratch: the proposer may write them while drafting (the
scheduler reserves ``SpeculativeConfig.lookahead_slots`` slots past each scheduled chunk for
that) and its next catch-up rewrites them before it attends to them.

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

    # True: the proposer keeps per-position state (draft KV; EAGLE: the target's hidden states),
    # so it sees every step; False: the runner skips ``propose`` on steps where no request wants
    # drafts.
    owns_kv: bool = False

    def __init__(self, num_speculative_tokens: int) -> None:
        self.k = num_speculative_tokens

    @abstractmethod
    def propose(self, step: ProposerStep) -> dict[str, list[int]]:
        """Called after every target step with every scheduled request (prompt chunks and
        requests that will not draft included, so a KV-owning proposer can track them).
        Returns up to K drafts for each request with ``wants_drafts`` (missing or [] means
        none); the scheduler may cut them (max tokens, model length, fallback)."""

    def draft_probs(self, request_id: str, num_drafts: int) -> torch.Tensor | None:  # [num_drafts, V]
        """q of the drafts last proposed for the request, for the rejection sampler; None (the
        default) when the drafts are a deterministic function of the context (a point mass)."""
        return None

    def finish(self, request_ids: Iterable[str]) -> None:  # noqa: B027 - optional hook
        """The requests finished or were aborted: drop any per-request state (KV needs nothing:
        their blocks go back to the pool with the target's)."""


@dataclass
class ProposerWork:
    """What a KV-owning proposer's own model ran, since it was built: forward calls and rows
    (catch-up and chained drafts); read by tests and profiles."""

    forwards: int = 0
    rows: int = 0

    def add(self, rows: int) -> None:
        self.forwards, self.rows = self.forwards + 1, self.rows + rows


class CatchUp:
    """Per request, where a KV-owning proposer's own KV stops being valid (module docstring)."""

    def __init__(self) -> None:
        self._valid: dict[str, int] = {}  # its KV is valid on positions [0, valid)
        self._computed: dict[str, int] = {}  # the target's verified end at the last step seen

    def valid(self, r: RequestProgress) -> int:
        """The first position r's proposer KV lacks; call once per step for every scheduled
        request (it notices recomputes by comparing ``r.start`` with the last step's end)."""
        rid = r.request_id
        valid = self._valid.get(rid, 0)
        if r.start < self._computed.get(rid, 0):  # preempted: its blocks may hold anything now
            valid = 0
        self._computed[rid] = r.start + r.num_verified
        self._valid[rid] = valid = min(valid, r.start + r.num_verified)
        return valid

    def caught_up(self, request_id: str, end: int) -> None:
        """The proposer ran its model on every position below ``end``."""
        self._valid[request_id] = end

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._valid.pop(rid, None)
            self._computed.pop(rid, None)


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
