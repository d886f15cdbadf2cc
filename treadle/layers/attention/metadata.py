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

Metadata is built once per step (``StepInputBuilder``: the runner's and the tests' one
builder) and passed to every attention layer as an argument; nothing is read from module
globals. The attention backend's per-step plan (``AttentionBackend.plan``) rides along in
``plan``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch


class DecodeKernelArgs(NamedTuple):
    """The index tensors the C decode kernels read on an all-decode CPU step."""

    slots: torch.Tensor  # [B] int64 contiguous, cache slot of each new K/V row
    block_tables: torch.Tensor  # [B, max_blocks] int32 contiguous
    seq_lens: torch.Tensor  # [B] int32 contiguous, new token included


class StepPlan:
    """What an attention backend works out once per step for every layer (its own
    subclass adds the rest). ``decode_kernel_args`` is set on all-decode CPU steps the
    one-call C decoder layer can take (``treadle.layers.fused_decoder``), else None."""

    @property
    def decode_kernel_args(self) -> DecodeKernelArgs | None:
        return None


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
    plan: StepPlan | None = None  # the backend's, set by the runner from AttentionBackend.plan
    # P/D layer-wise start: the model calls it with i before layer i runs (some KV still arriving)
    wait_for_layer: Callable[[int], None] | None = None
    # hybrid KV (core/kv_groups.py): layer i reads and writes through layer_meta[i] (its group's block
    # tables and slots, same tokens and positions); None: every layer through this one
    layer_meta: list[AttentionMetadata] | None = None

    def for_layer(self, layer: int) -> AttentionMetadata:
        return self if self.layer_meta is None else self.layer_meta[layer]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


class StepInputs(NamedTuple):
    positions: torch.Tensor  # [num_tokens] int64; on the CPU a view of the builder's buffer (valid until next build)
    meta: AttentionMetadata


class StepInputBuilder:
    """Positions, slot mapping and block tables of a step's flat batch, written into
    persistent numpy buffers (reused every step; grown when a step is larger)."""

    def __init__(self, block_size: int, max_num_tokens: int = 0, device: torch.device | str = "cpu") -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        self._pos = np.zeros(max_num_tokens, dtype=np.int64)

    def build(self, query_lens: list[int], seq_lens: list[int], block_tables: Sequence[Sequence[int]]) -> StepInputs:
        """Sequence i's ``query_lens[i]`` new tokens end at position ``seq_lens[i]``; its
        blocks are ``block_tables[i]`` (physical ids, in logical order). No numpy call per
        sequence: this runs every step, and at batch 1 a step is ~10 ms on the CPU."""
        bs, n_seq, n_tok = self.block_size, len(query_lens), sum(query_lens)
        if n_tok > self._pos.shape[0]:
            self._pos = np.zeros(n_tok, dtype=np.int64)
        tables = np.zeros((n_seq, max(map(len, block_tables), default=0) or 1), dtype=np.int32)
        for i, row in enumerate(block_tables):
            tables[i, : len(row)] = row
        pos = self._pos[:n_tok]
        if n_tok == n_seq:  # one new token each (decode): plain Python on B numbers
            qsl = np.arange(n_seq + 1, dtype=np.int32)
            pos[:] = [length - 1 for length in seq_lens]
            slots = np.array([row[p // bs] * bs + p % bs for row, p in zip(block_tables, pos.tolist())], dtype=np.int64)
        else:
            q, s = np.array(query_lens, dtype=np.int64), np.array(seq_lens, dtype=np.int64)
            qsl = np.zeros(n_seq + 1, dtype=np.int32)
            np.cumsum(q, out=qsl[1:], dtype=np.int32)
            seq = np.repeat(np.arange(n_seq), q)  # each new token's sequence
            np.add(np.arange(n_tok) - qsl[:-1][seq], (s - q)[seq], out=pos)
            slots = tables[seq, pos // bs].astype(np.int64) * bs + pos % bs
        meta = AttentionMetadata(
            query_lens=list(query_lens),
            seq_lens=list(seq_lens),
            query_start_loc=self._to_device(qsl),
            seq_lens_tensor=self._to_device(np.array(seq_lens, dtype=np.int32)),
            block_tables=self._to_device(tables),
            slot_mapping=self._to_device(slots),
            block_size=bs,
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
        )
        return StepInputs(self._to_device(pos), meta)

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        return t if self.device.type == "cpu" else t.to(self.device)


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """One step's metadata from host-side lists (tests and simple callers; the runner
    keeps one ``StepInputBuilder``)."""
    return StepInputBuilder(block_size, sum(query_lens), device).build(query_lens, seq_lens, block_tables).meta
