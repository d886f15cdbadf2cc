"""The scheduler's waiting queue: a binary heap with lazy deletion.

Removing a request (abort, client gone) only marks its entry dead, O(1); dead
entries are dropped when they reach the top, and the heap is rebuilt once they
outnumber the live ones, so removing k of n requests costs O(k + n) amortized
instead of O(k * n) for rebuilding the heap per removal.

    heap:  [live a] [dead x] [live b] [dead y] ...   len(heap) = live + dead
    peek/pop skip dead tops; compaction when dead > live keeps len(heap) <= 2 * live + 1
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class WaitingQueue(Generic[T]):
    """Items ordered by ``key(item)`` (smallest first), FIFO among equal keys.
    An item is in the queue at most once (``push`` of a present item is an error)."""

    def __init__(self, key: Callable[[T], Any]) -> None:
        self._key = key
        self._heap: list[tuple[Any, int, T]] = []
        self._entry: dict[int, int] = {}  # id(item) -> sequence number of its live entry
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._entry)

    def __bool__(self) -> bool:
        return bool(self._entry)

    def __contains__(self, item: T) -> bool:
        return id(item) in self._entry

    def __iter__(self) -> Iterator[T]:
        """Live items, in no particular order."""
        return (item for _, seq, item in self._heap if self._entry.get(id(item)) == seq)

    def push(self, item: T) -> None:
        if id(item) in self._entry:
            raise ValueError("item is already queued")
        seq = next(self._counter)
        self._entry[id(item)] = seq
        heapq.heappush(self._heap, (self._key(item), seq, item))

    def peek(self) -> T:
        """The first live item; IndexError when empty."""
        self._drop_dead_tops()
        return self._heap[0][2]

    def pop(self) -> T:
        self._drop_dead_tops()
        _, _, item = heapq.heappop(self._heap)
        del self._entry[id(item)]
        return item

    def remove(self, item: T) -> bool:
        """Take ``item`` out (O(1) amortized); False if it was not queued."""
        if self._entry.pop(id(item), None) is None:
            return False
        if len(self._heap) > 2 * len(self._entry) + 1:
            self._compact()
        return True

    def _drop_dead_tops(self) -> None:
        heap = self._heap
        while heap and self._entry.get(id(heap[0][2])) != heap[0][1]:
            heapq.heappop(heap)

    def _compact(self) -> None:
        self._heap = [e for e in self._heap if self._entry.get(id(e[2])) == e[1]]
        heapq.heapify(self._heap)
