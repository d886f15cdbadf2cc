"""StepInputBuilder, the one builder of a step's positions and attention metadata (the
runner's, reused every step, and the tests'), against the definition written out by hand."""
from __future__ import annotations

import random

import torch

from treadle.layers.attention import StepInputBuilder


def by_hand(query_lens: list[int], seq_lens: list[int], tables: list[list[int]], bs: int) -> tuple[list[int], list[int]]:
    positions, slots = [], []
    for q, s, table in zip(query_lens, seq_lens, tables):
        for p in range(s - q, s):
            positions.append(p)
            slots.append(table[p // bs] * bs + p % bs)
    return positions, slots


def test_builder_matches_the_definition_and_survives_reuse() -> None:
    rng = random.Random(0)
    builder = StepInputBuilder(block_size=4, max_num_tokens=8)  # grows when a step is larger
    earlier = None
    for _ in range(20):
        n = rng.randint(1, 5)
        seq_lens = [rng.randint(1, 40) for _ in range(n)]
        query_lens = [rng.randint(1, s) for s in seq_lens]
        blocks = rng.sample(range(200), sum(-(-s // 4) for s in seq_lens))
        tables, at = [], 0
        for s in seq_lens:
            tables.append(blocks[at : at + -(-s // 4)])
            at += len(tables[-1])
        positions, meta = builder.build(query_lens, seq_lens, tables)
        want_pos, want_slots = by_hand(query_lens, seq_lens, tables, 4)
        assert positions.tolist() == want_pos and meta.slot_mapping.tolist() == want_slots
        assert meta.query_start_loc.tolist() == [sum(query_lens[:i]) for i in range(n + 1)]
        assert meta.seq_lens_tensor.dtype == meta.block_tables.dtype == torch.int32
        assert meta.block_tables.shape == (n, max(map(len, tables)))
        assert (meta.max_query_len, meta.max_seq_len, meta.plan) == (max(query_lens), max(seq_lens), None)
        if earlier is not None:  # the previous step's metadata is its own (slot mapping copied out)
            assert earlier[0].slot_mapping.tolist() == earlier[1]
        earlier = (meta, want_slots)
