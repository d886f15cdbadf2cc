"""Layer-wise start on the consumer: which layers of each load in flight have landed, and the
wait the model makes before a layer whose KV may still be arriving.

    step N:  start_step(loads + streaming ids)    pull threads: layer 0 lands, 1 lands, ...
             model: wait(0) layer 0  wait(1) layer 1  ...   (each wait returns once that layer
                                                              of every streaming load landed)

A wait that cannot be met (the pull failed, or its deadline passed) cancels that pull and waits
until its thread has stopped, so when the step returns no pull still writes into the request's
blocks; the pull's own failure report then tells the scheduler side to discard the request's
step output and recompute its prompt. The other requests of the step are not affected: the
failed request's rows read only its own blocks.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

STOP_WAIT_S = 5.0  # a cancelled pull stops within one poll slice or one layer write; this is the safety net


@dataclass
class _Load:
    cancel: threading.Event
    deadline: float  # time.monotonic() past which the model stops waiting for it
    landed: set[int] = field(default_factory=set)
    ended: bool = False


class LoadProgress:
    """Per request id: the layers written so far and whether its pull thread has ended."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._loads: dict[str, _Load] = {}

    def start(self, rid: str, timeout_s: float) -> threading.Event:
        """A pull is submitted; its cancel flag (the pull stops at its next wait once set)."""
        load = _Load(threading.Event(), time.monotonic() + timeout_s)
        with self._cond:
            self._loads[rid] = load
        return load.cancel

    def cancel_flag(self, rid: str) -> threading.Event | None:
        with self._cond:
            load = self._loads.get(rid)
        return None if load is None else load.cancel

    def landed(self, rid: str, layer: int) -> None:
        with self._cond:
            load = self._loads.get(rid)
            if load is not None:
                load.landed.add(layer)
                self._cond.notify_all()

    def ended(self, rid: str) -> None:
        """The pull thread is done (after reporting success or failure): it writes nothing more."""
        with self._cond:
            load = self._loads.pop(rid, None)
            if load is not None:
                load.ended = True
                self._cond.notify_all()

    def wait_ended(self, rids: list[str]) -> None:
        """Block until the pulls of ``rids`` have ended (each reported finished or failed). Called
        after a step whose model waited for every layer of them: they only have to report, so
        the step's report says how each ended (under TP every rank's, merged in that step)."""
        deadline = time.monotonic() + STOP_WAIT_S
        with self._cond:
            self._cond.wait_for(lambda: not any(rid in self._loads for rid in rids),
                                max(0.0, deadline - time.monotonic()))

    def wait(self, rids: list[str], layer: int) -> list[str]:
        """Block until ``layer`` of every load in ``rids`` landed; returns the ids whose wait
        failed (pull ended without it, or its deadline passed), after their pulls stopped.
        An id whose pull already ended is not waited for: its outcome is reported already."""
        failed = []
        for rid in rids:
            with self._cond:
                load = self._loads.get(rid)
                if load is None:
                    continue
                self._cond.wait_for(lambda ld=load: layer in ld.landed or ld.ended,  # type: ignore[misc]
                                    max(0.0, load.deadline - time.monotonic()))
                if layer in load.landed:
                    continue
                load.cancel.set()
                deadline = time.monotonic() + STOP_WAIT_S
                self._cond.wait_for(lambda ld=load: ld.ended, max(0.0, deadline - time.monotonic()))  # type: ignore[misc]
            failed.append(rid)
        return failed
