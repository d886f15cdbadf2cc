"""Scheduling policies: the order of the waiting queue and the choice of whom to preempt.

The scheduler asks its policy two things, both on plain data carried by the request:

- ``queue_key(req)``: the waiting queue's order (smallest first), computed when the request
  is (re)queued — at admission and again after a preemption;
- ``choose_victim(running)``: whom to preempt under KV pressure — the running request the
  queue order would serve last.

Policies (``scheduling_policy``):

- ``fcfs``: arrival order; explicit priorities are ignored (vLLM's ``fcfs``).
- ``priority``: explicit priority (lower first), then arrival — Treadle's rule before there
  was a choice, and the default.
- ``predicted``: explicit priority first, then requests passed over ``max_passed_over`` times
  (oldest first), then a *virtual start time*

      virtual = arrival + aging_s * cost / (cost + COST_HALF)

  where ``cost`` is the predicted remaining work in decode-token units:
  ``PREFILL_TOKEN_COST`` per prompt (or recompute) token not yet computed, plus the predicted
  output tokens not yet generated (``predicted_remaining``). Requests that arrive together are
  served shortest predicted job first; a long job is delayed by less than ``aging_s``.

The aging bound (tested): ``cost / (cost + COST_HALF) < 1``, so ``virtual < arrival + aging_s``.
A request of the same priority that arrives ``aging_s`` or more after R has
``virtual >= its arrival >= arrival(R) + aging_s > virtual(R)``: it is ordered after R, and
preempted before R. So no request is passed over by one that arrived ``aging_s`` seconds or
more after it; only requests that arrived within that window can overtake it.

    arrival(R)          virtual(R)      arrival(R) + aging_s
       |-------------------|-------------------|------------------->  time
       [ may overtake R: arrived here ...      ][ never overtakes R  ]

Two bounds (both tested), because the time bound alone trades the tail for the median: a long
job that waits behind every short one arriving within ``aging_s`` ends up last of its busy period
(measured: p99 1.45x worse than fcfs at ``aging_s`` 60 s, docs/scheduling.md).

- *Time*: ``cost / (cost + COST_HALF) < 1``, so ``virtual < arrival + aging_s`` (above).
- *Count*: a request is *passed over* when one that arrived after it, of the same or a less
  urgent explicit priority, is admitted while it waits (``PassOverCount``). Once passed over
  ``max_passed_over`` times it goes first among its priority (oldest first), so no request is
  overtaken by more than ``max_passed_over`` later arrivals of its priority, however short
  their predicted jobs. Each pass costs it at most one admission's worth of waiting.

The key is fixed while a request waits (the waiting queue is a heap), so it stays O(log n) per
push; predictions are re-ranked where the request is seen again: preemption re-queues it with
its remaining cost, and victim choice reads the running requests' current remaining cost.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Any

from treadle.config import SchedulerConfig, TreadleError
from treadle.core.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority", "predicted")
PREFILL_TOKEN_COST = 0.1  # one prompt token costs this many decode tokens (batched prefill is cheap)
COST_HALF = 128.0  # remaining cost (decode tokens) at which a request's delay is half of aging_s
UNKNOWN_OUTPUT_TOKENS = 128  # predicted output when a request carries no prediction


def runs_to_max_tokens(ignore_eos: Any, stop: Any, stop_token_ids: Any) -> bool:
    """A request that cannot stop early (EOS ignored, no stop strings or ids) runs to its
    max_tokens: its output length is known, not predicted (the engine and the router's queue)."""
    return ignore_eos is True and not stop and not stop_token_ids


def predicted_total(req: Request) -> int:
    """The output length this request is expected to reach: its prediction (or
    UNKNOWN_OUTPUT_TOKENS), at most ``max_tokens``. Once it has generated that many and goes on
    (an overrun), the expectation doubles what it has generated so far."""
    pred = req.predicted_output_tokens if req.predicted_output_tokens is not None else UNKNOWN_OUTPUT_TOKENS
    generated = len(req.output_token_ids)
    if generated >= pred:
        pred = 2 * generated
    return min(max(pred, 1), req.max_tokens)


def predicted_remaining(req: Request) -> int:
    """Output tokens still to generate, by the prediction (re-ranked on overrun)."""
    return max(0, predicted_total(req) - len(req.output_token_ids))


def remaining_cost(req: Request) -> float:
    """Predicted remaining work in decode-token units: uncomputed prompt (or recompute)
    tokens at PREFILL_TOKEN_COST each, plus the predicted remaining output."""
    uncomputed = max(0, req.num_tokens - req.num_computed_tokens)
    return PREFILL_TOKEN_COST * uncomputed + predicted_remaining(req)


def aged_start(arrival: float, cost: float, aging_s: float) -> float:
    """arrival + aging_s * cost / (cost + COST_HALF): always below arrival + aging_s (the
    engine's waiting queue and the router's dispatch queue order by it)."""
    return arrival + aging_s * cost / (cost + COST_HALF)


def virtual_start(req: Request, aging_s: float) -> float:
    return aged_start(req.arrival_time, remaining_cost(req), aging_s)


@dataclass(frozen=True)
class SchedulingPolicy:
    """Queue order and victim choice of one ``scheduling_policy``; ``aging_s`` only matters
    to ``predicted``."""


    name: str
    aging_s: float
    max_passed_over: int = 20

    @staticmethod
    def from_config(config: SchedulerConfig) -> SchedulingPolicy:
        return SchedulingPolicy(config.scheduling_policy, config.scheduling_aging_s,
                                config.scheduling_max_passed_over)

    def __post_init__(self) -> None:
        if self.name not in SCHEDULING_POLICIES:
            raise TreadleError(f"scheduling_policy {self.name!r} is not one of {', '.join(SCHEDULING_POLICIES)}")
        if not self.aging_s > 0:
            raise TreadleError(f"scheduling_aging_s must be positive, not {self.aging_s!r}")
        if self.max_passed_over < 0:
            raise TreadleError(f"scheduling_max_passed_over must be >= 0, not {self.max_passed_over!r}")

    @property
    def counts_passes(self) -> bool:
        """Whether the scheduler must keep a ``PassOverCount`` (predicted only)."""
        return self.name == "predicted"

    def overdue(self, req: Request) -> bool:
        """Passed over the most times allowed: it goes first among its priority."""
        return self.name == "predicted" and req.num_passed_over >= self.max_passed_over

    def queue_key(self, req: Request) -> tuple[Any, ...]:
        """Waiting order, smallest first (ties: first pushed first)."""
        if self.name == "fcfs":
            return (req.arrival_time,)
        if self.name == "priority":
            return (req.priority, req.arrival_time)
        if self.overdue(req):
            return (req.priority, 0, req.arrival_time, req.arrival_time)
        return (req.priority, 1, virtual_start(req, self.aging_s), req.arrival_time)

    def choose_victim(self, running: list[Request]) -> Request:
        """The request to preempt: the one the queue order serves last (latest arrival for
        fcfs; lowest priority then latest arrival for priority; lowest priority then the
        latest virtual start, with the remaining cost as it is now, for predicted)."""
        return max(running, key=self.queue_key)


class PassOverCount:
    """The waiting requests in arrival order, to count how often each is passed over.

    ``admitted(r)`` adds one to every waiting request that arrived before ``r`` with the same or
    a more urgent priority (lower value) and returns those that just reached ``cap``: the
    scheduler re-queues them so their key (``SchedulingPolicy.overdue``) puts them first. It
    touches only requests older than the admitted one (the ones passed over, usually few);
    adding and removing is a bisect in an arrival-sorted list."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._order: list[tuple[float, int, Request]] = []  # (arrival, seq, request), sorted
        self._key: dict[int, tuple[float, int]] = {}  # id(req) -> its (arrival, seq)
        self._seq = itertools.count()

    def add(self, req: Request) -> None:
        key = (req.arrival_time, next(self._seq))
        bisect.insort(self._order, (*key, req))
        self._key[id(req)] = key

    def discard(self, req: Request) -> None:
        key = self._key.pop(id(req), None)
        if key is not None:
            del self._order[bisect.bisect_left(self._order, key)]

    def admitted(self, req: Request) -> list[Request]:
        """``req`` left the queue to run: count the passes it made; -> requests now overdue."""
        self.discard(req)
        reached = []
        for _, _, older in self._order[: bisect.bisect_left(self._order, (req.arrival_time,))]:
            if older.priority <= req.priority and older.num_passed_over < self.cap:
                older.num_passed_over += 1
                if older.num_passed_over == self.cap:
                    reached.append(older)
        return reached
