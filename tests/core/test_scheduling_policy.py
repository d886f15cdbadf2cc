"""Scheduling policies (core/cost_policy.py) with hand-built requests: no model, no engine."""
from __future__ import annotations

import pytest

from treadle.config import SchedulerConfig, TreadleError
from treadle.core.cost_policy import (
    COST_HALF,
    PREFILL_TOKEN_COST,
    SchedulingPolicy,
    predicted_remaining,
    remaining_cost,
    virtual_start,
)
from treadle.core.kv_cache_manager import KVCacheManager
from treadle.core.request import Request
from treadle.core.scheduler import Scheduler
from treadle.core.step_data import ModelRunnerOutput, SchedulerOutput
from treadle.sampling_params import SamplingParams

AGING = 10.0


def req(rid: str, n_prompt: int = 8, predicted: int | None = 10, arrival: float = 0.0, priority: int = 0,
        max_tokens: int = 500, first_token: int = 100) -> Request:
    r = Request(rid, list(range(first_token, first_token + n_prompt)), SamplingParams(max_tokens=max_tokens), max_tokens,
                eos_token_ids=(2,), arrival_time=arrival, priority=priority)
    r.predicted_output_tokens = predicted
    return r


def scheduler(policy: str = "predicted", num_blocks: int = 1024, max_seqs: int = 1, budget: int = 64,
              max_passed_over: int = 16) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=4096,
                          enable_chunked_prefill=True, scheduling_policy=policy, scheduling_aging_s=AGING,
                          scheduling_max_passed_over=max_passed_over)
    return Scheduler(cfg, KVCacheManager(num_blocks, 4))


def admission_order(s: Scheduler) -> list[str]:
    """Ids in the order they leave the waiting queue (pops the whole queue)."""
    order = []
    while s.num_waiting:
        order.append(s._waiting.pop().request_id)
    return order


def test_predicted_orders_shortest_predicted_job_first():
    s = scheduler()
    for rid, pred in [("long", 400), ("short", 3), ("medium", 60)]:
        s.add_request(req(rid, predicted=pred))
    assert admission_order(s) == ["short", "medium", "long"]


def test_fcfs_and_priority_orders():
    for policy, expected in [("fcfs", ["a", "b", "c"]), ("priority", ["c", "a", "b"])]:
        s = scheduler(policy)
        s.add_request(req("a", predicted=400, arrival=0.0, priority=1))
        s.add_request(req("b", predicted=3, arrival=1.0, priority=1))
        s.add_request(req("c", predicted=400, arrival=2.0, priority=0))
        assert admission_order(s) == expected, policy


def test_prefill_counts_in_the_cost():
    """Same predicted output, a much longer prompt: the short prompt goes first."""
    s = scheduler()
    s.add_request(req("long-prompt", n_prompt=600, predicted=5))
    s.add_request(req("short-prompt", n_prompt=8, predicted=5))
    assert admission_order(s) == ["short-prompt", "long-prompt"]
    assert remaining_cost(req("x", n_prompt=600, predicted=5)) == pytest.approx(600 * PREFILL_TOKEN_COST + 5)


def test_explicit_priority_wins_over_prediction():
    s = scheduler()
    s.add_request(req("short-low", predicted=1, priority=5))
    s.add_request(req("long-high", predicted=500, priority=0, arrival=3.0))
    assert admission_order(s) == ["long-high", "short-low"]


def test_aging_bound_no_request_passed_over_by_one_arriving_aging_s_later():
    """A very long request at t=0 and short ones arriving every 0.5 s for 3 * aging_s: only
    those that arrived less than aging_s after it go first."""
    s = scheduler()
    s.add_request(req("huge", n_prompt=900, predicted=3000, max_tokens=3000))
    arrivals = [0.5 * i for i in range(1, int(6 * AGING))]
    for i, t in enumerate(arrivals):
        s.add_request(req(f"s{i}", predicted=1, arrival=t))
    order = admission_order(s)
    passed_by = [arrivals[int(rid[1:])] for rid in order[: order.index("huge")]]
    assert passed_by and max(passed_by) < AGING  # the bound holds ...
    assert max(passed_by) > AGING / 2  # ... and is not vacuous: a long job does wait for shorter ones
    assert virtual_start(req("x", predicted=10**9, max_tokens=10**9), AGING) < AGING


def test_overrun_is_re_ranked():
    r = req("r", predicted=10)
    assert predicted_remaining(r) == 10
    r.output_token_ids = [5] * 4
    assert predicted_remaining(r) == 6
    r.output_token_ids = [5] * 30  # past its prediction: expected to run as long again
    assert predicted_remaining(r) == 30
    r.max_tokens = 40  # never past max_tokens
    assert predicted_remaining(r) == 10
    assert predicted_remaining(req("none", predicted=None, max_tokens=3)) == 3


def test_victim_is_the_request_with_the_most_predicted_work_left():
    policy = SchedulingPolicy("predicted", AGING)
    a, b, c = req("a", predicted=20), req("b", predicted=300), req("c", predicted=50)
    for r in (a, b, c):
        r.num_computed_tokens = r.num_prompt_tokens
    assert policy.choose_victim([a, b, c]) is b
    b.output_token_ids = [5] * 295  # b is nearly done now; a overran to 60 generated (60 more expected)
    a.output_token_ids = [5] * 60
    assert policy.choose_victim([a, b, c]) is a
    hi = req("hi", predicted=900, priority=0)
    lo = req("lo", predicted=1, priority=3)
    assert policy.choose_victim([hi, lo]) is lo  # priority still decides first
    assert SchedulingPolicy("fcfs", AGING).choose_victim([req("x", arrival=1.0), req("y", arrival=2.0)]).request_id == "y"


def fake_step(s: Scheduler, out: SchedulerOutput, stop_at: dict[str, int]) -> None:
    """Sample token 7 for every request that reached its end; EOS (2) at its true length."""
    sampled = {}
    for sr in out.scheduled:
        r = s.requests[sr.request_id]
        if sr.num_computed_tokens + sr.num_scheduled_tokens == r.num_tokens:
            sampled[sr.request_id] = [2 if len(r.output_token_ids) + 1 >= stop_at[r.request_id] else 7]
    s.update_from_output(out, ModelRunnerOutput(sampled=sampled))


def test_kv_pressure_preempts_the_longest_predicted_and_all_finish():
    """A cache too small for all three: the long one is preempted (not the latest arrival, as
    fcfs would), and every request still finishes with its full length."""
    true_len = {"long": 40, "s1": 6, "s2": 6}
    s = scheduler(num_blocks=12, max_seqs=3)
    reqs = [req("long", predicted=40, arrival=0.0, max_tokens=40), req("s1", predicted=6, arrival=0.1, max_tokens=40,
                                                                     first_token=300),
            req("s2", predicted=6, arrival=0.2, max_tokens=40, first_token=500)]
    s.add_request(reqs[0])
    finished_order = []
    for step in range(500):
        if step == 10:  # the long one has been generating for a while when the short ones come
            s.add_request(reqs[1])
            s.add_request(reqs[2])
        if not s.has_unfinished():
            break
        before = set(s.requests)
        fake_step(s, s.schedule(), true_len)
        finished_order += sorted(before - set(s.requests))
    assert finished_order[-1] == "long" and s.num_preemptions > 0
    assert reqs[0].num_preemptions > 0 and reqs[1].num_preemptions == reqs[2].num_preemptions == 0
    assert [len(r.output_token_ids) for r in reqs] == [40, 6, 6]
    assert s.kv.num_free_blocks == 12


def run_to_end(s: Scheduler, stop_at: dict[str, int]) -> list[str]:
    """Step the scheduler until every request finished -> ids in the order they were first scheduled."""
    started: list[str] = []
    for _ in range(5000):
        if not s.has_unfinished():
            return started
        out = s.schedule()
        started += [sr.request_id for sr in out.scheduled if sr.request_id not in started]
        fake_step(s, out, stop_at)
    raise AssertionError("did not finish")


def test_count_bound_no_request_passed_over_more_than_max_passed_over():
    """One slot, a long job and 12 short ones arriving just after it (all within the aging
    window, so the time bound alone would let every one of them go first): exactly CAP of them
    pass it, then it runs; the rest wait for it."""
    cap = 5
    s = scheduler(max_passed_over=cap)
    true_len = {"long": 30}
    s.add_request(req("first", predicted=2, max_tokens=30))  # takes the slot, so the others queue
    s.add_request(req("long", predicted=30, max_tokens=30, arrival=0.1, first_token=900))
    true_len["first"] = 2
    for i in range(12):
        rid = f"s{i}"
        s.add_request(req(rid, predicted=2, max_tokens=30, arrival=0.2 + 0.01 * i, first_token=1000 + 50 * i))
        true_len[rid] = 2
    order = run_to_end(s, true_len)
    assert order[0] == "first"
    assert order.index("long") == 1 + cap  # passed over by exactly cap later arrivals ...
    assert order[1:1 + cap] == [f"s{i}" for i in range(cap)]  # ... the shortest-first ones
    assert s.requests == {} and s.kv.num_free_blocks == 1024


def test_count_bound_counts_only_the_same_or_less_urgent_priority():
    policy = SchedulingPolicy("predicted", AGING, max_passed_over=2)
    overdue = req("overdue", predicted=500, priority=1)
    overdue.num_passed_over = 2
    fresh_urgent = req("urgent", predicted=500, priority=0, arrival=5.0)
    fresh_same = req("same", predicted=1, priority=1, arrival=5.0)
    keys = sorted([overdue, fresh_urgent, fresh_same], key=policy.queue_key)
    assert [r.request_id for r in keys] == ["urgent", "overdue", "same"]  # explicit priority still wins

    s = scheduler(max_passed_over=2)
    s.add_request(req("first", predicted=1, max_tokens=8))
    s.add_request(req("low", predicted=50, priority=3, arrival=0.1, max_tokens=50, first_token=300))
    for i in range(4):  # more urgent arrivals overtaking "low" are not passes
        s.add_request(req(f"u{i}", predicted=1, priority=0, arrival=0.2 + i, max_tokens=8, first_token=400 + 20 * i))
    order = run_to_end(s, {"first": 1, "low": 5, **{f"u{i}": 1 for i in range(4)}})
    assert order == ["first", "u0", "u1", "u2", "u3", "low"]


def test_unknown_policy_is_one_clear_error():
    with pytest.raises(TreadleError, match="scheduling_policy 'sjf'"):
        scheduler("sjf")
    with pytest.raises(TreadleError, match="aging"):
        SchedulingPolicy("predicted", 0.0)
    with pytest.raises(TreadleError, match="max_passed_over"):
        SchedulingPolicy("predicted", AGING, -1)
    assert COST_HALF > 0
