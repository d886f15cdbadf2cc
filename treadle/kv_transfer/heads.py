"""Which KV heads each consumer rank pulls from which producer rank, when producer and consumer
run different tensor-parallel sizes (pure functions; both ends derive the same plan).

Every rank of an instance holds the KV heads ``kv_head_range`` gives it (``distributed/
sharding.py``: K / T heads each, or one replicated head when T > K). Producer rank p serves its
heads on ``kv_port + p``; consumer rank c pulls exactly the heads it holds, each from the first
producer rank that holds it, sliced on the producer's side (bytes sent = bytes the rank needs)::

    K = 4 KV heads           producer TP 2                consumer TP 1
                             rank 0: heads 0 1  --------> rank 0: heads 0 1 | 2 3
                             rank 1: heads 2 3  --------'
    K = 4                    producer TP 1                consumer TP 2
                             rank 0: heads 0 1 2 3 --+--> rank 0: heads 0 1
                                                     '--> rank 1: heads 2 3
    K = 1 (replicated)       producer TP 2                consumer TP 1
                             rank 0: head 0  -----------> rank 0: head 0
                             rank 1: head 0  <- - - - - - an empty pull (a release)

A producer rank reports a request's blocks sent once every consumer rank whose plan names it
has pulled; a producer rank no consumer rank needs gets an empty pull from consumer rank 0,
so every rank of the producer reports every request and its blocks are freed at once.
"""
from __future__ import annotations

from typing import NamedTuple

from treadle.distributed.sharding import kv_head_range
from treadle.kv_transfer.wire import TransferError


class RankPlacement(NamedTuple):
    """Where one worker sits in its instance, as far as KV heads go."""

    num_kv_heads: int  # the model's, all ranks together
    tp_size: int
    tp_rank: int

    @staticmethod
    def single(num_kv_heads: int) -> RankPlacement:
        return RankPlacement(num_kv_heads, 1, 0)


class HeadSlice(NamedTuple):
    """One pull of a consumer rank: ``num_heads`` heads from ``producer_rank``."""

    producer_rank: int
    src_head: int  # first head, counted in the producer rank's own heads
    dst_head: int  # first head, counted in the consumer rank's own heads
    num_heads: int  # 0: an empty pull, only so the producer rank hears the request is done


def check_tp_size(num_kv_heads: int, tp: int) -> None:
    """TransferError unless ``tp`` ranks can hold ``num_kv_heads`` heads (sharding's rule)."""
    if tp < 1 or not (num_kv_heads % tp == 0 or tp % num_kv_heads == 0):
        raise TransferError(f"tensor-parallel size {tp} cannot hold {num_kv_heads} KV heads")


def pull_plan(num_kv_heads: int, producer_tp: int, consumer_tp: int) -> list[list[HeadSlice]]:
    """For each consumer rank, its pulls (in producer-rank order)."""
    check_tp_size(num_kv_heads, producer_tp)
    check_tp_size(num_kv_heads, consumer_tp)
    held = [kv_head_range(num_kv_heads, producer_tp, p) for p in range(producer_tp)]
    plans: list[list[HeadSlice]] = []
    for c in range(consumer_tp):
        mine = kv_head_range(num_kv_heads, consumer_tp, c)
        plan: list[HeadSlice] = []
        for head in mine:
            p = next(p for p, heads in enumerate(held) if head in heads)
            if plan and plan[-1].producer_rank == p:
                last = plan[-1]
                plan[-1] = last._replace(num_heads=last.num_heads + 1)
            else:
                plan.append(HeadSlice(p, head - held[p].start, head - mine.start, 1))
        plans.append(plan)
    used = {s.producer_rank for plan in plans for s in plan}
    plans[0] += [HeadSlice(p, 0, 0, 0) for p in range(producer_tp) if p not in used]
    return plans


def num_pullers(num_kv_heads: int, producer_tp: int, consumer_tp: int, producer_rank: int) -> int:
    """How many consumer ranks pull from ``producer_rank`` (each once per request)."""
    plans = pull_plan(num_kv_heads, producer_tp, consumer_tp)
    return sum(any(s.producer_rank == producer_rank for s in plan) for plan in plans)
