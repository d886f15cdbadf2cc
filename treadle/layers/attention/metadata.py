"""Attention metadata: the explicit description of one step's flat batch.

The model runner lays the tokens of all scheduled sequences end to end::

    flat tokens:  | seq0: q0 tokens | seq1: q1 tokens | ... |
    query_start_loc = [0, q0, q0+q1, ...]

Sequence ``i`` already has ``seq_lens[i] - query_lens[i]`` tokens in the paged
cache; its new tokens sit at positions ``[seq_lens[i] - query_lens[i], seq_lens[i])``.
Position ``p`` of sequence ``i`` lives in physical slot
``block_tables[i][p // block_size] * block_size + p % block_size``::

    logical blocks   0        1        2
    block_table[i] = [7,       2,       9]      (physical block ids)
    position 37 with block_size 16 -> logical 2, offset 5 -> slot 9*16+5 = 149

Metadata is built once per step and passed to every attention layer as an
argument; nothing is read from module globals.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    query_lens: list[int]  # [num_seqs] new tokens per sequence (host side)
    seq_lens: list[int]  # [num_seqs] context length incl. new tokens (host side)
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens_tensor: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, slot of each new token; -1 = skip
    block_size: int
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


def compute_slot_mapping(
    query_lens: torch.Tensor,  # [num_seqs] int64
    seq_lens: torch.Tensor,  # [num_seqs] int64
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
    block_size: int,
) -> torch.Tensor:
    """Physical slot for every new token, vectorised (no Python loop over tokens)."""
    num_seqs = query_lens.shape[0]
    seq_index = torch.repeat_interleave(torch.arange(num_seqs), query_lens)
    starts = torch.cumsum(query_lens, 0) - query_lens
    offset_in_query = torch.arange(int(query_lens.sum())) - starts[seq_index]
    positions = (seq_lens - query_lens)[seq_index] + offset_in_query
    blocks = block_tables[seq_index, positions // block_size]
    return blocks * block_size + positions % block_size


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Build metadata from host-side lists (used by tests and simple callers)."""
    max_blocks = max((len(b) for b in block_tables), default=0) or 1
    bt = torch.zeros((len(block_tables), max_blocks), dtype=torch.int64)
    for i, row in enumerate(block_tables):
        bt[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
    ql = torch.tensor(query_lens, dtype=torch.int64)
    sl = torch.tensor(seq_lens, dtype=torch.int64)
    slots = compute_slot_mapping(ql, sl, bt, block_size)
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(ql, 0)
    return AttentionMetadata(
        query_lens=list(query_lens),
        seq_lens=list(seq_lens),
        query_start_loc=qsl.to(device),
        seq_lens_tensor=sl.to(torch.int32).to(device),
        block_tables=bt.to(torch.int32).to(device),
        slot_mapping=slots.to(device),
        block_size=block_size,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
    )
