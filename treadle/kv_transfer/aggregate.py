"""The ranks' transfer reports merged into one, for an instance of several tensor-parallel ranks
(the executor does this; the scheduler side then reads the instance's report as it reads a
single rank's). Every rank reports every load and every held request exactly once, each when
it is done with it (``tcp.py``), perhaps in different steps::

    step    rank 0                 rank 1                  merged (2 ranks)
    5       loaded a               -                       -
    6       -                      failed a (checksum)     failed a: recompute on every rank
    7       sent p                 -                       -
    9       -                      sent p                  sent p: the blocks may be freed

A load is finished once every rank finished it, and failed (first reason kept) once every rank
ended it and any failed: only then is no rank still writing its blocks, so the scheduler may
recompute into them; it has started (layer-wise start) once every rank reported it started.
Held blocks count as sent once every rank stopped reading them, and as released (not pulled)
if any rank stopped because of a release message.
"""
from __future__ import annotations

from treadle.core.kv_connector_data import KVConnectorOutput


class KVOutputAggregator:
    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self._loads: dict[str, tuple[int, str | None]] = {}  # request -> (ranks ended, first failure)
        self._sends: dict[str, tuple[int, bool]] = {}  # request -> (ranks that stopped serving it, any released)
        self._starts: dict[str, int] = {}  # request -> ranks whose pull started
        self._merged = KVConnectorOutput()  # complete, not yet handed out

    def merge(self, outputs: list[KVConnectorOutput | None]) -> KVConnectorOutput | None:
        """One step's reports of every rank -> the instance's (None when nothing ended)."""
        self.add(outputs)
        merged, self._merged = self._merged, KVConnectorOutput()
        ended = (merged.finished_loading or merged.failed_loading or merged.finished_sending
                 or merged.released_unpulled or merged.started_loading)
        return merged if ended or merged.num_bytes_received else None

    def add(self, outputs: list[KVConnectorOutput | None]) -> None:
        """Count reports without handing anything out yet (a step failed on another rank:
        what these ranks reported comes out with the next ``merge``)."""
        merged = self._merged
        for out in outputs:
            if out is None:
                continue
            merged.num_bytes_received += out.num_bytes_received
            for rid in out.started_loading:
                self._starts[rid] = self._starts.get(rid, 0) + 1
                if self._starts[rid] == self.num_ranks:
                    del self._starts[rid]
                    merged.started_loading.append(rid)
            for rid in out.finished_loading:
                self._end_load(merged, rid, None)
            for rid, why in out.failed_loading.items():
                self._end_load(merged, rid, why)
            for rid, released in [(r, False) for r in out.finished_sending] + [(r, True) for r in out.released_unpulled]:
                count, any_released = self._sends.pop(rid, (0, False))
                count, any_released = count + 1, any_released or released
                if count < self.num_ranks:
                    self._sends[rid] = (count, any_released)
                else:
                    (merged.released_unpulled if any_released else merged.finished_sending).append(rid)

    def _end_load(self, merged: KVConnectorOutput, rid: str, why: str | None) -> None:
        self._starts.pop(rid, None)  # a rank that failed before starting never reports it
        count, failure = self._loads.pop(rid, (0, None))
        count, failure = count + 1, failure or why
        if count < self.num_ranks:
            self._loads[rid] = (count, failure)
        elif failure is None:
            merged.finished_loading.append(rid)
        else:
            merged.failed_loading[rid] = failure

    @property
    def num_pending(self) -> int:
        """Requests some ranks, not all, have reported (0 when every report is complete)."""
        return len(self._loads) + len(self._sends)
