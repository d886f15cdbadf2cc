"""The router's dispatch queue (``--queue fcfs|predicted``): requests wait in the router, not in
one instance's queue, until an instance of the generating role has a free batch slot.

Without it every request goes to an instance at once and waits in that instance's queue, so a
request can wait behind a busy instance while the other one frees a slot first, and a burst of
long jobs can pile up on one instance. With it the instances' slots are one pool (their
``max_num_seqs``, read from ``/load``) and the router decides who runs next:

- ``fcfs``: arrival order;
- ``predicted``: shortest predicted job first, with the engine's two bounds (``core/cost_policy.py``,
  ``docs/scheduling.md``): the key is ``aged_start(arrival, cost, aging_s)``, so nobody is passed
  over by a request that arrived ``aging_s`` or more after it, and a request passed over
  ``max_passed_over`` times goes first (oldest first). ``cost`` is the request's predicted work
  in decode tokens: ``PREFILL_TOKEN_COST`` x prompt tokens + the predicted output tokens (at most
  ``max_tokens``), times ``n``; the forwarder asks an instance's ``/tokenize`` for both numbers
  (``predicted_output_tokens``, from the instance's length predictor).

A request holds its slot from its grant until its answer or stream ends (retries on another
instance keep it). Slots: the sum of ``max_num_seqs`` over the generating instances not out of
rotation; while one of them reports no ``max_num_seqs`` (not a Treadle instance, or not polled
yet) or all are out of rotation, nothing waits (the forwarder's own retry and 503 rules apply).
Requests sent to the instances by anyone but this router are not counted.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from treadle.core.cost_policy import aged_start
from treadle.router.instances import InstancePool

QUEUE_ORDERS = ("off", "fcfs", "predicted")


@dataclass(eq=False)
class Waiter:
    arrival: float
    cost: float  # predicted work, decode-token units (unused by fcfs)
    seq: int  # arrival order among waiters (ties)
    granted: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    passed_over: int = 0


class DispatchQueue:
    def __init__(self, pool: InstancePool, role: str, order: str, aging_s: float = 120.0,
                 max_passed_over: int = 20) -> None:
        if order not in QUEUE_ORDERS[1:]:
            raise ValueError(f"queue order {order!r} is not one of {', '.join(QUEUE_ORDERS[1:])}")
        self.pool, self.role, self.order = pool, role, order
        self.aging_s, self.max_passed_over = aging_s, max_passed_over
        self.waiting: list[Waiter] = []  # in arrival order
        self.active = 0  # granted and not yet released
        self.max_wait_s = 0.0
        self._seq = itertools.count()

    def capacity(self) -> int | None:
        """Batch slots of the generating instances in rotation; None: unbounded (do not queue)."""
        insts = [i for i in self.pool.instances if i.role.value == self.role and not i.out]
        slots = [i.load.max_num_seqs for i in insts]
        if not insts or any(not s for s in slots):
            return None
        return sum(slots)  # type: ignore[arg-type]

    def key(self, w: Waiter) -> tuple[float, ...]:
        if self.order == "fcfs":
            return (w.arrival, w.seq)
        if w.passed_over >= self.max_passed_over:
            return (0, w.arrival, w.seq)
        return (1, aged_start(w.arrival, w.cost, self.aging_s), w.seq)

    def dispatch(self) -> None:
        """Grant free slots to the waiters that go first. Called whenever a slot frees, a
        waiter arrives, or a poll changes the capacity."""
        self.waiting = [w for w in self.waiting if not w.granted.done()]  # cancelled waiters leave
        while self.waiting:
            cap = self.capacity()
            if cap is not None and self.active >= cap:
                return
            w = min(self.waiting, key=self.key)
            self.waiting.remove(w)
            for older in self.waiting:
                if older.seq < w.seq:
                    older.passed_over += 1
            self.active += 1
            w.granted.set_result(None)

    def release(self) -> None:
        self.active -= 1
        self.dispatch()

    @contextlib.asynccontextmanager
    async def slot(self, cost: float) -> AsyncIterator[float]:
        """Wait for this request's turn; yields the seconds it waited. The slot is released when
        the block ends (use ``acquire`` / ``release`` for a slot that outlives a block)."""
        waited = await self.acquire(cost)
        try:
            yield waited
        finally:
            self.release()

    async def acquire(self, cost: float) -> float:
        """Wait for this request's turn and take a slot (the caller must ``release`` it);
        returns the seconds waited."""
        start = time.monotonic()
        w = Waiter(start, cost, next(self._seq))
        self.waiting.append(w)
        self.dispatch()
        try:
            await w.granted
        except asyncio.CancelledError:
            if w.granted.done() and not w.granted.cancelled():
                self.release()  # granted, but the client left before it could use the slot
            else:
                w.granted.cancel()
                self.dispatch()
            raise
        waited = time.monotonic() - start
        self.max_wait_s = max(self.max_wait_s, waited)
        return waited
