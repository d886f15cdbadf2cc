"""Test helper: run a loaded model over the paged KV cache, the way the engine
does (a batch of sequences, prefill then one token at a time), with deliberately
scattered, non-contiguous block tables."""
from __future__ import annotations

import random

import torch

from treadle.layers.attention import StepInputBuilder
from treadle.loaders import LoadedModel


def scattered_block_tables(seq_lens: list[int], block_size: int, g: torch.Generator,
                           spare: int) -> tuple[list[list[int]], int]:
    """Block tables for sequences of ``seq_lens`` tokens over a shuffled pool with ``spare``
    blocks no sequence uses: (tables, number of blocks in the pool)."""
    need = [-(-s // block_size) for s in seq_lens]
    perm = torch.randperm(sum(need) + spare, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    return tables, len(perm)


class PagedSession:
    def __init__(self, lm: LoadedModel, num_seqs: int, max_len: int, block_size: int = 4, seed: int = 0,
                 cache_dtype: torch.dtype | None = None) -> None:
        cfg = lm.config
        self.model = lm.model
        self.block_size = block_size
        blocks_per_seq = -(-max_len // block_size)
        num_blocks = num_seqs * blocks_per_seq + 3  # a few never used
        order = list(range(num_blocks))
        random.Random(seed).shuffle(order)
        # sequence i owns every num_seqs-th block of a shuffled pool: scattered and interleaved
        self.tables = [order[i : num_seqs * blocks_per_seq : num_seqs] for i in range(num_seqs)]
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        dtype = cache_dtype or lm.model.dtype  # default: the activations' dtype (weights may be quantized bytes)
        self.caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(cfg.num_layers)]
        self.lens = [0] * num_seqs
        self.inputs = StepInputBuilder(block_size)  # the runner's builder

    @torch.no_grad()
    def feed(self, new_tokens: list[list[int]]) -> list[torch.Tensor]:
        """Append tokens to every sequence; returns each sequence's logits [n_new, vocab]."""
        query_lens = [len(t) for t in new_tokens]
        seq_lens = [n + q for n, q in zip(self.lens, query_lens)]
        ids = torch.tensor([tok for toks in new_tokens for tok in toks], dtype=torch.long)
        positions, meta = self.inputs.build(query_lens, seq_lens, self.tables)
        meta.plan = self.model.backend.plan(meta)  # as the runner does, once per step
        logits = self.model.compute_logits(self.model(ids, positions, self.caches, meta))
        self.lens = seq_lens
        return list(logits.split(query_lens))


def greedy(lm: LoadedModel, prompts: list[list[int]], max_new_tokens: int, stop_ids: tuple[int, ...] = ()) -> list[list[int]]:
    """Greedy continuations of a batch of prompts, decoded together; a sequence ends
    at a stop id (included) or after max_new_tokens."""
    session = PagedSession(lm, len(prompts), max(map(len, prompts)) + max_new_tokens)
    last = [row[-1] for row in session.feed(prompts)]
    outputs: list[list[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens):
        for out, row in zip(outputs, last):
            if not (out and out[-1] in stop_ids):
                out.append(int(row.argmax()))
        if step + 1 < max_new_tokens:  # finished sequences keep feeding their last token; output is frozen
            last = [row[-1] for row in session.feed([[out[-1]] for out in outputs])]
    return outputs
