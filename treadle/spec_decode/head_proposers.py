"""Proposers that draft from the target's hidden states with a trained head (``heads.py``;
the contract: ``proposer.py``).

Medusa has no KV: for each drafting request, its last verified row h_t (the row that produced
the new token x at t+1) goes through the K heads at once; head k drafts token t+k+2.

EAGLE owns one layer of KV in the target's block pool (same block ids and slot mapping). Its
index j pairs the target's h_j with the token after it, x_{j+1}; the token after the last
verified position is the new token x. It catches up lazily (``proposer.py``: ``CatchUp``): the
layer runs only for requests that draft this step, so every step it keeps what a later
catch-up needs, the target's hidden state of each verified position, in a paged tensor of its
own (``hidden_cache``: [num_blocks * block_size, H] in the target's dtype, indexed by the
target's slot mapping like the KV, so it needs no cap, survives rollback and comes with a
prefix hit; the KV planner counts its H values per token):

    every step, every request: hidden_cache[slot(j)] = h_j, j in [s, s+v)   (a copy, no compute)
    request r drafting, its head KV valid on [c, ...) missing (c = CatchUp.valid, c <= s):
    catch-up   one flat forward over the drafting requests: (hidden_cache[slot(j)], x_{j+1}) at
               index j, j in [c, s+v) -> g at index s+v-1 -> d1 = argmax lm_head(g)
    chain      up to K-1 one-row forwards: (g, d_i) at index s+v-1+i -> the next g, d_{i+1}
               (as many as the request's last verify earned: ``DraftLength``)
               (indices >= s+v are scratch, in the scheduler's lookahead slots: rewritten by
               the next catch-up before anyone attends to them)

A request whose KV came from elsewhere (a P/D transfer) has no hidden rows for those positions:
its drafts attend to whatever the slots hold (acceptance may suffer, never exactness: the
verifier decides every token).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
import torch

from treadle.layers.attention import StepInputBuilder
from treadle.models.llama import KVCache, LlamaForCausalLM
from treadle.sample.sampler import argmax_rows
from treadle.spec_decode.heads import EagleLayer, MedusaHeads
from treadle.spec_decode.proposer import CatchUp, DraftLength, Proposer, ProposerStep, ProposerWork, RequestProgress


class DraftVocab:
    """Where a head's drafts are the argmax of its feature: over the target's whole lm_head, or
    (``ids``: the head file's ``draft_vocab``) over the float rows of those tokens only. With
    SmolLM2's 49152 tokens the whole lm_head is most of a draft's cost (a chain of K drafts
    would cost about as much as a target step); a few thousand rows cost a tenth of it. A draft
    outside the subset is never proposed: that costs acceptance, never exactness."""

    def __init__(self, target: LlamaForCausalLM, ids: torch.Tensor | None = None) -> None:
        self.target = target
        self.ids: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None
        if ids is not None:
            head = target.embed_tokens if target.lm_head is None else target.lm_head
            self.ids = ids.to(torch.long).to(target.norm.weight.device)
            self.rows = head.method.embedding(head, self.ids, torch.float32)  # [n, H]

    def argmax(self, features: torch.Tensor) -> list[int]:
        if self.rows is None or self.ids is None:
            logits = self.target.compute_logits(features)
            assert logits is not None, "speculation runs on one rank"
            return argmax_rows(logits)
        return self.ids[argmax_rows(features.float() @ self.rows.T)].tolist()


class MedusaProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, heads: MedusaHeads, target: LlamaForCausalLM,
                 vocab: DraftVocab | None = None) -> None:
        super().__init__(num_speculative_tokens)
        self.heads, self.target = heads, target
        self.vocab = vocab if vocab is not None else DraftVocab(target)

    @torch.inference_mode()
    def propose(self, step: ProposerStep) -> dict[str, list[int]]:
        rows = [r for r in step.requests if r.wants_drafts and r.num_verified > 0]
        if not rows or step.hidden is None:
            return {}
        index = torch.tensor([r.flat_start + r.num_verified - 1 for r in rows], device=step.hidden.device)
        feats = self.heads(step.hidden.index_select(0, index).float())[: self.k]  # [K, n, H]
        k, n, h = feats.shape
        tokens = self.vocab.argmax(feats.reshape(k * n, h).to(self.target.dtype))
        return {r.request_id: tokens[i::n] for i, r in enumerate(rows)}


class _Run(NamedTuple):
    request: RequestProgress
    begin: int  # first EAGLE index run in the catch-up
    end: int  # one past the last


class EagleProposer(Proposer):
    owns_kv = True

    def __init__(self, num_speculative_tokens: int, layer: EagleLayer, kv_cache: KVCache,
                 hidden_cache: torch.Tensor, block_size: int, max_positions: int,
                 device: torch.device | str = "cpu", vocab: DraftVocab | None = None) -> None:
        """``kv_cache``: the layer's (k, v) over the target's block ids; ``hidden_cache``:
        [num_blocks * block_size, H], the target's hidden state per slot."""
        super().__init__(num_speculative_tokens)
        self.layer, self.kv_cache, self.max_positions = layer, kv_cache, max_positions
        self.hidden_cache, self.block_size = hidden_cache, block_size
        self.vocab = vocab if vocab is not None else DraftVocab(layer.target[0])
        self.length = DraftLength(num_speculative_tokens)
        self.catch_up = CatchUp()
        self.work = ProposerWork()
        self.backend = layer.target[0].backend
        self.device = torch.device(device)
        self.inputs = StepInputBuilder(block_size, 0, self.device)

    def _forward(self, runs: list[_Run], tokens: list[int], hidden: torch.Tensor | None) -> torch.Tensor:
        """The layer over each run's indices [begin, end) (rows in run order); features [n, H].
        ``hidden`` None: the target's hidden states of those indices, from ``hidden_cache``."""
        query_lens = [r.end - r.begin for r in runs]
        positions, meta = self.inputs.build(query_lens, [r.end for r in runs], [r.request.block_ids for r in runs])
        meta.plan = self.backend.plan(meta)
        if hidden is None:
            hidden = self.hidden_cache.index_select(0, meta.slot_mapping)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        self.work.add(len(tokens))
        return self.layer(ids, hidden, positions, self.kv_cache, meta)

    def _keep_hidden(self, step: ProposerStep) -> None:
        """Copy every verified row's hidden state to its slot in ``hidden_cache``."""
        assert step.hidden is not None
        slots, rows, bs = [], [], self.block_size
        for r in step.requests:
            if r.num_verified <= 0:
                continue
            pos = np.arange(r.start, r.start + r.num_verified)
            slots.append(np.asarray(r.block_ids, dtype=np.int64)[pos // bs] * bs + pos % bs)
            rows.append(np.arange(r.flat_start, r.flat_start + r.num_verified))
        if slots:
            dev = self.hidden_cache.device
            index = torch.from_numpy(np.concatenate(rows)).to(step.hidden.device)
            self.hidden_cache.index_copy_(0, torch.from_numpy(np.concatenate(slots)).to(dev),
                                          step.hidden.index_select(0, index).to(self.hidden_cache.dtype))

    def _catch_up(self, step: ProposerStep) -> tuple[list[_Run], torch.Tensor] | None:
        """One forward over the missing indices of every request that drafts now (its catch-up
        reaches the new token's predecessor); the features at each run's rows."""
        runs, tokens = [], []
        for r in step.requests:
            valid = self.catch_up.valid(r)
            end = len(r.token_ids) - 1
            if not r.wants_drafts or end != r.start + r.num_verified or end > self.max_positions:
                continue
            if end > valid:
                runs.append(_Run(r, valid, end))
                tokens += r.token_ids[valid + 1 : end + 1]
                self.catch_up.caught_up(r.request_id, end)
        if not runs:
            return None
        return runs, self._forward(runs, tokens, None)

    def finish(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        self.length.forget(request_ids)
        self.catch_up.forget(request_ids)

    @torch.inference_mode()
    def propose(self, step: ProposerStep) -> dict[str, list[int]]:
        if step.hidden is None:
            return {}
        self._keep_hidden(step)
        caught = self._catch_up(step)
        if caught is None:
            return {}
        runs, feats = caught
        last = torch.tensor([r.end - r.begin for r in runs], device=feats.device).cumsum(0) - 1
        feat = feats.index_select(0, last)
        first = self.vocab.argmax(feat)
        drafts = {r.request.request_id: [t] for r, t in zip(runs, first)}
        lengths = [self.length.of(r.request) for r in runs]
        for i in range(1, self.k):
            keep = [j for j, r in enumerate(runs)
                    if i < lengths[j] and r.end + i <= min(r.request.num_slots, self.max_positions)]
            if not keep:
                break
            runs, feat, lengths = [runs[j] for j in keep], feat[keep], [lengths[j] for j in keep]
            index_runs = [_Run(r.request, r.end - 1 + i, r.end + i) for r in runs]
            ids = [drafts[r.request.request_id][-1] for r in runs]
            feat = self._forward(index_runs, ids, feat)
            for r, t in zip(runs, self.vocab.argmax(feat)):
                drafts[r.request.request_id].append(t)
        return drafts
