"""Hybrid KV (core/kv_groups.py, core/kv_cache_manager.py) with the scheduler and hand-built
runner outputs (no model): a full-attention group keeps every block, sliding groups keep
their window, the prefix cache takes a hit only where each sliding group still holds the
window before it."""
from __future__ import annotations

import pytest

from treadle.config import SchedulerConfig
from treadle.core.kv_cache_manager import NULL_BLOCK, KVCacheManager
from treadle.core.kv_groups import KVGroup, KVGroups
from treadle.core.request import Request
from treadle.core.scheduler import Scheduler
from treadle.core.step_data import ModelRunnerOutput, SchedulerOutput
from treadle.sampling_params import SamplingParams

BS, WINDOW = 16, 32
WINDOWS = (None, WINDOW, WINDOW)  # one full group, two sliding groups


def make(num_blocks: int = 200, budget: int = 64, windows: tuple[int | None, ...] = WINDOWS) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=2048,
                          enable_chunked_prefill=True)
    return Scheduler(cfg, KVCacheManager(num_blocks, BS, True, windows))


def request(rid: str, tokens: list[int], max_tokens: int) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), max_tokens)


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    sampled = {x.request_id: [5] for x in out.scheduled
               if x.num_computed_tokens + x.num_scheduled_tokens == s.requests[x.request_id].num_tokens}
    s.update_from_output(out, ModelRunnerOutput(sampled=sampled))
    return out


def test_groups_from_layer_windows() -> None:
    gemma_270m = [None if i % 6 == 5 else 512 for i in range(18)]
    groups = KVGroups.from_windows(gemma_270m)
    assert groups.group_size == 3 and groups.windows == (None,) + (512,) * 5
    assert groups.groups[0] == KVGroup((5, 11, 17), None)
    assert groups.groups[-1] == KVGroup((14, 15, 16), 512)
    assert [groups.slot_of(i) for i in (5, 11, 17, 0, 1, 2, 3)] == [0, 1, 2, 0, 1, 2, 0]
    assert not KVGroups.from_windows([None] * 4).hybrid  # one kind of layer: one table
    assert not KVGroups.from_windows([64] * 4).hybrid  # all sliding (Mistral): one table, as before


def test_long_sequence_holds_full_blocks_plus_windows() -> None:
    """A 600-token prompt in 64-token chunks, then 39 decodes: after every step the full
    group holds every block and each sliding group only the blocks that the next token's
    window reaches, and the pool counts exactly those blocks as used."""
    s = make()
    kv = s.kv
    r = request("a", list(range(600)), 41)
    s.add_request(r)
    while r.num_computed_tokens < 639:
        step(s)
        c = r.num_computed_tokens
        full, *sliding = kv.blocks_held("a")
        assert full == -(-c // BS)
        first_seen = max(0, c - WINDOW + 1) // BS  # block of the oldest key the next token sees
        assert sliding == [full - first_seen] * 2 and all(n <= -(-WINDOW // BS) + 1 for n in sliding)
        assert kv.pool.num_blocks - kv.num_free_blocks == full + sum(sliding)
        ids = kv.group_block_ids("a")
        assert all(t[:first_seen] == [NULL_BLOCK] * first_seen for t in ids)
    full, *sliding = kv.blocks_held("a")
    assert full == 40 and sliding == [2, 2]  # 639 tokens: 44 blocks, vs 3 x 40 with one table


def test_admission_counts_a_window_per_sliding_group() -> None:
    s = make(num_blocks=60)
    s.add_request(request("fits", list(range(700)), 10))  # 45 full + 2 x min(45, 7) = 59 blocks
    with pytest.raises(Exception, match="KV blocks"):
        s.add_request(request("too-long", list(range(800)), 10))  # 51 + 14 = 65 > 60


def _run_alone(s: Scheduler, r: Request) -> list[list[int]]:
    """Run ``r`` to its end; returns each sliding table's block ids before they went NULL."""
    s.add_request(r)
    seen: list[list[int]] = []
    while not r.status.finished:
        step(s)
        for g, ids in enumerate(s.kv.group_block_ids(r.request_id)):
            if len(seen) <= g:
                seen.append([])
            for i, b in enumerate(ids):
                if i >= len(seen[g]):
                    seen[g].append(b)
                elif b != NULL_BLOCK:
                    seen[g][i] = b
    return seen


def test_prefix_hit_takes_the_window_blocks_given_back_earlier() -> None:
    """The sliding blocks behind the window were given back while the first request ran, but
    stay indexed: a second prompt sharing 96 tokens takes 6 full blocks and, per sliding
    group, only the 2 blocks holding the window before position 96 (vLLM's rule)."""
    s = make()
    prefix = list(range(1000, 1096))
    first = request("a", prefix + [1, 2, 3], 20)
    sliding = _run_alone(s, first)
    second = request("b", prefix + [7, 8, 9, 10], 4)
    hit = s.kv.match_prefix(second)
    assert hit.num_blocks == 6
    lo = (96 - WINDOW + 1) // BS  # 4
    for g, table in enumerate(hit.tables[1:]):
        assert table[:lo] == [None] * lo
        assert [b.block_id for b in table[lo:] if b is not None] == sliding[g][lo:6]
    s.add_request(second)
    step(s)
    assert second.num_cached_prompt_tokens == 96
    assert s.kv.blocks_held("b") == [7, 3, 3]  # 6 hit blocks + 1 new; window 4..6 per sliding group


def _window_cached(cached: list[list[bool]], q: int) -> bool:
    lo = max(0, q * BS - WINDOW + 1) // BS
    return all(all(c[lo:q]) for c in cached)


def test_prefix_hit_shortens_to_where_every_window_is_cached() -> None:
    """Evict the least recently freed blocks (the sliding blocks given back early): the hit is
    the longest prefix whose full blocks and each sliding group's window blocks are all still
    cached, checked by brute force over the block ids the first request held; some evictions
    leave the hit whole, others shorten it."""
    outcomes = set()
    for shared in (64, 128):
        for evicted in (0, 1, 4, 5, 8):
            s = make(num_blocks=27, budget=32)
            prefix = list(range(2000, 2128))
            sliding = _run_alone(s, request("a", prefix + [1], 1))
            kv = s.kv
            kv.pool.allocate(evicted)  # takes the free list's head: evicts those blocks' content
            cached = [[kv.pool.blocks[b].key is not None and kv.pool.blocks[b].ref_cnt == 0 for b in ids]
                      for ids in sliding]

            expected = max(q for q in range(shared // BS + 1) if _window_cached(cached, q))
            hit = kv.match_prefix(request("b", prefix[:shared] + [9], 4))
            assert hit.num_blocks == expected, (shared, evicted)
            outcomes.add(expected == shared // BS)
    assert outcomes == {True, False}


def test_trim_and_free_give_every_block_back() -> None:
    s = make()
    r = request("a", list(range(300)), 5)
    s.add_request(r)
    while not r.status.finished:
        step(s)
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks


def test_one_group_is_the_single_table_of_before() -> None:
    s = make(windows=(None,))
    r = request("a", list(range(200)), 3)
    s.add_request(r)
    while not r.status.finished:
        step(s)
        if not r.status.finished:
            assert s.kv.blocks_held("a") == [-(-r.num_computed_tokens // BS)]
            assert s.kv.group_block_ids("a") == []
