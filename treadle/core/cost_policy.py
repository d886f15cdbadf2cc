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
- ``predicted``: explicit priority first, then a *virtual start time*

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

The key is fixed while a request waits (the waiting queue is a heap), so it stays O(log n) per
push; predictions are re-ranked where the request is seen again: preemption re-queues it with
its remaining cost, and victim choice reads the running requests' current remaining cost.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from treadle.config import SchedulerConfig, TreadleError
from treadle.core.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority", "predicted")
PREFILL_TOKEN_COST = 0.1  # one prompt token costs this many decode tokens (batched prefill is cheap)
COST_HALF = 128.0  # remaining cost (decode tokens) at which a request's delay is half of aging_s
UNKNOWN_OUTPUT_TOKENS = 128  # predicted output when a request carries no prediction


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


def virtual_start(req: Request, aging_s: float) -> float:
    """arrival + aging_s * cost / (cost + COST_HALF): always below arrival + aging_s."""
    cost = remaining_cost(req)
    return req.arrival_time + aging_s * cost / (cost + COST_HALF)


@dataclass(frozen=True)
class SchedulingPolicy:
    """Queue order and victim choice of one ``scheduling_policy``; ``aging_s`` only matters
    to ``predicted``."""


    name: str
    aging_s: float

    @staticmethod
    def from_config(config: SchedulerConfig) -> SchedulingPolicy:
        return SchedulingPolicy(config.scheduling_policy, config.scheduling_aging_s)

    def __post_init__(self) -> None:
        if self.name not in SCHEDULING_POLICIES:
            raise TreadleError(f"scheduling_policy {self.name!r} is not one of {', '.join(SCHEDULING_POLICIES)}")
        if not self.aging_s > 0:
            raise TreadleError(f"scheduling_aging_s must be positive, not {self.aging_s!r}")

    def queue_key(self, req: Request) -> tuple[Any, ...]:
        """Waiting order, smallest first (ties: first pushed first)."""
        if self.name == "fcfs":
            return (req.arrival_time,)
        if self.name == "priority":
            return (req.priority, req.arrival_time)
        return (req.priority, virtual_start(req, self.aging_s), req.arrival_time)

    def choose_victim(self, running: list[Request]) -> Request:
        """The request to preempt: the one the queue order serves last (latest arrival for
        fcfs; lowest priority then latest arrival for priority; lowest priority then the
        latest virtual start, with the remaining cost as it is now, for predicted)."""
        return max(running, key=self.queue_key)
