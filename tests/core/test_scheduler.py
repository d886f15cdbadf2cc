"""Scheduler and KV block manager on the CPU with hand-built runner outputs (no model)."""
from __future__ import annotations

import pytest

from treadle.config import SchedulerConfig, TreadleError
from treadle.core.block_pool import BlockPool
from treadle.core.kv_cache_manager import KVCacheManager
from treadle.core.request import Request, RequestStatus
from treadle.core.scheduler import Scheduler
from treadle.core.step_data import ModelRunnerOutput, SchedulerOutput
from treadle.sampling_params import SamplingParams


def make_scheduler(num_blocks=64, block_size=4, budget=32, max_seqs=8, chunked=True, max_len=256):
    kv = KVCacheManager(num_blocks, block_size)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_len,
                          enable_chunked_prefill=chunked)
    return Scheduler(cfg, kv)


def req(rid, n_prompt, max_tokens=4, arrival=0.0, priority=0, first_token=100):
    return Request(rid, list(range(first_token, first_token + n_prompt)), SamplingParams(max_tokens=max_tokens),
                   max_tokens, eos_token_ids=(2,), arrival_time=arrival, priority=priority)


def fake_run(sched_out: SchedulerOutput, sched: Scheduler, token: int = 7) -> ModelRunnerOutput:
    """Sample ``token`` for every request whose scheduled tokens reach its end."""
    sampled = {}
    for s in sched_out.scheduled:
        r = sched.requests[s.request_id]
        if s.num_computed_tokens + s.num_scheduled_tokens == r.num_tokens:
            sampled[s.request_id] = [token]
    return ModelRunnerOutput(sampled=sampled)


def run_to_end(sched: Scheduler, max_steps=1000) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return outs
        o = sched.schedule()
        outs.append(o)
        sched.update_from_output(o, fake_run(o, sched))
    raise AssertionError("did not finish")


def test_block_pool_refcounts_and_eviction_order():
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert pool.num_free_blocks == 2
    pool.cache(a[0], (0, (1, 2)))
    pool.touch([a[0]])
    pool.free([a[0]])
    assert a[0].ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free([a[1], a[0]])
    assert pool.num_free_blocks == 4
    assert pool.lookup((0, (1, 2))) is a[0]  # still cached while free
    pool.allocate(3)  # takes the never-used blocks first, then a[1] (freed first)
    assert pool.lookup((0, (1, 2))) is a[0]
    pool.allocate(1)
    assert pool.lookup((0, (1, 2))) is None  # evicted on reuse


def test_chunked_prefill_fuses_with_decodes():
    s = make_scheduler(budget=8)
    s.add_request(req("a", 3, max_tokens=5))
    o1 = s.schedule()
    assert [(x.request_id, x.num_scheduled_tokens) for x in o1.scheduled] == [("a", 3)]
    s.update_from_output(o1, fake_run(o1, s))
    s.add_request(req("b", 20, arrival=1.0))
    o2 = s.schedule()
    # running decode first (1 token), then a 7-token chunk of the waiting prompt
    assert [(x.request_id, x.num_scheduled_tokens) for x in o2.scheduled] == [("a", 1), ("b", 7)]
    s.update_from_output(o2, fake_run(o2, s))
    o3 = s.schedule()
    assert [(x.request_id, x.num_computed_tokens, x.num_scheduled_tokens) for x in o3.scheduled] == [
        ("a", 4, 1), ("b", 7, 7)]


def test_chunking_off_schedules_whole_prompts():
    s = make_scheduler(budget=16, chunked=False)
    s.add_request(req("a", 10))
    s.add_request(req("b", 10, arrival=1.0))
    o = s.schedule()
    assert [(x.request_id, x.num_scheduled_tokens) for x in o.scheduled] == [("a", 10)]


def test_no_leaks_after_finish_and_abort():
    s = make_scheduler(num_blocks=32)
    for i in range(5):
        s.add_request(req(f"r{i}", 5 + i, max_tokens=6, arrival=float(i)))
    o = s.schedule()
    s.update_from_output(o, fake_run(o, s))
    s.abort(["r1", "r3"])
    run_to_end(s)
    assert s.kv.num_free_blocks == 32
    assert not s.running and s.num_waiting == 0


def test_preemption_by_recompute_lowest_priority_latest_arrival():
    s = make_scheduler(num_blocks=6, block_size=4, budget=64)
    early, late = req("early", 8, max_tokens=8, arrival=0.0), req("late", 8, max_tokens=8, arrival=1.0)
    s.add_request(early)
    s.add_request(late)
    run_to_end(s)
    assert s.num_preemptions > 0
    assert late.num_preemptions > 0 and early.num_preemptions == 0
    assert len(early.output_token_ids) == len(late.output_token_ids) == 8
    assert s.kv.num_free_blocks == 6


def test_priority_orders_waiting_queue():
    s = make_scheduler(budget=8, max_seqs=1)
    s.add_request(req("low", 4, arrival=0.0, priority=5))
    s.add_request(req("high", 4, arrival=1.0, priority=0))
    o = s.schedule()
    assert [x.request_id for x in o.scheduled] == ["high"]


def test_prefix_cache_hit_reuses_blocks():
    s = make_scheduler(num_blocks=32, block_size=4)
    s.add_request(req("a", 13, max_tokens=2))
    run_to_end(s)
    s.add_request(req("b", 13, max_tokens=2))
    o = s.schedule()
    # 12 of 13 prompt tokens are in full cached blocks; one token left to compute
    assert o.scheduled[0].num_computed_tokens == 12 and o.scheduled[0].num_scheduled_tokens == 1
    assert s.requests["b"].num_cached_prompt_tokens == 12


def test_refuses_impossible_requests():
    s = make_scheduler(num_blocks=4, block_size=4, max_len=64)
    with pytest.raises(TreadleError, match="max_model_len"):
        s.add_request(req("x", 60, max_tokens=10))
    with pytest.raises(TreadleError, match="KV blocks"):
        s.add_request(req("y", 20, max_tokens=10))
    s.add_request(req("ok", 4, max_tokens=4))  # the queue is not stalled
    run_to_end(s)


def test_stop_token_and_max_tokens_finish():
    s = make_scheduler()
    r = req("a", 4, max_tokens=10)
    s.add_request(r)
    o = s.schedule()
    s.update_from_output(o, ModelRunnerOutput(sampled={"a": [2]}))  # EOS
    assert r.status is RequestStatus.FINISHED_STOPPED and r.stop_reason is None  # EOS: None, as vLLM
    r2 = req("b", 4, max_tokens=2)
    s.add_request(r2)
    run_to_end(s)
    assert r2.status is RequestStatus.FINISHED_LENGTH and len(r2.output_token_ids) == 2


class _CountingKey:
    """A queue key that counts the comparisons the heap makes."""

    def __init__(self, value: float, counter: list[int]) -> None:
        self.value, self.counter = value, counter

    def __lt__(self, other: _CountingKey) -> bool:
        self.counter[0] += 1
        return self.value < other.value

    def __eq__(self, other: object) -> bool:
        self.counter[0] += 1
        return isinstance(other, _CountingKey) and self.value == other.value

    __hash__ = None  # type: ignore[assignment]


def test_waiting_queue_removal_is_not_quadratic():
    """Removing k of n waiting items one by one costs O(k + n log n) comparisons in all
    (lazy deletion), not O(k * n) as rebuilding the heap per removal did."""
    from treadle.core.waiting_queue import WaitingQueue

    counter = [0]
    items = [object() for _ in range(20_000)]
    q: WaitingQueue[object] = WaitingQueue(lambda it: _CountingKey(float(items_index[id(it)]), counter))
    items_index = {id(it): i for i, it in enumerate(items)}
    for it in reversed(items):
        q.push(it)
    pushed = counter[0]
    counter[0] = 0
    for it in items[::2]:  # remove every other one, the head first each time
        assert q.remove(it)
    assert not q.remove(items[0])
    assert len(q) == 10_000 and items[1] in q and items[0] not in q
    n_log_n = 20_000 * 15
    assert counter[0] <= 2 * n_log_n, counter[0]  # a heap rebuild per removal would be ~10^8
    assert [q.pop() for _ in range(3)] == items[1:6:2]  # order kept among the survivors
    assert pushed <= 2 * n_log_n


def test_waiting_queue_readd_after_remove_and_fifo_ties():
    from treadle.core.waiting_queue import WaitingQueue

    a, b, c = object(), object(), object()
    q: WaitingQueue[object] = WaitingQueue(lambda it: 0)
    for it in (a, b, c):
        q.push(it)
    q.remove(a)
    q.push(a)  # back in, behind the others; the dead entry is skipped
    assert [q.pop() for _ in range(3)] == [b, c, a] and not q
    with pytest.raises(IndexError):
        q.peek()


def test_aborting_thousands_of_waiting_requests_keeps_order_and_counts():
    s = make_scheduler(num_blocks=64, max_seqs=2, budget=8)
    reqs = [req(f"r{i}", 4, arrival=float(i)) for i in range(6000)]
    for r in reqs:
        s.add_request(r)
    s.abort([r.request_id for r in reqs if int(r.request_id[1:]) % 3])  # two thirds leave
    assert s.num_waiting == 2000
    first = s.schedule()
    assert [x.request_id for x in first.scheduled] == ["r0", "r3"]
    s.abort([r.request_id for r in reqs])
    assert s.num_waiting == 0 and not s.has_unfinished()
