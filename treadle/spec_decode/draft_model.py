"""The draft-model proposer: a smaller model with the target's vocabulary drafts K tokens
greedily, with its KV in the target's block pool (same block ids and slot mapping, see
``proposer.py``).

    step t, request r (target computed positions start .. start+n-1, verified v of them,
    sampled the new token x at position start+v), its draft KV valid below c (``CatchUp``):

    catch-up   one flat forward over the requests that draft:  tokens [c, start+v) + x
               (a request that does not draft: nothing; its positions wait for its next
               catch-up, ``proposer.py``)   -> d1 = argmax at x's row
    draft      K-1 single-token forwards:  d_i at position start+v+i -> d_{i+1}
               (positions past start+v are scratch: overwritten before anyone reads them)

A layer-skip draft (``"model": "self:N"``) is the target's first N layers, its final norm and
lm_head: its KV *is* the target's KV of those layers, already valid for every computed
position, so it skips the catch-up of verified positions and only runs x and the drafts (their
scratch slots are rewritten by the target's next step before it attends to them).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple, Protocol

import torch

from treadle.distributed.vocab import vocab_embedding
from treadle.layers.attention import AttentionBackend, AttentionMetadata, StepInputBuilder
from treadle.models.llama import KVCache, LlamaForCausalLM
from treadle.sample.sampler import argmax_rows
from treadle.spec_decode.proposer import CatchUp, Proposer, ProposerStep, ProposerWork, RequestProgress


class DraftLM(Protocol):
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                 meta: AttentionMetadata) -> torch.Tensor: ...  # [num_tokens, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None: ...  # [n, vocab]


class LayerSkipDraft:
    """The target's first ``num_layers`` decoder layers + final norm + lm_head (no second file)."""

    def __init__(self, target: LlamaForCausalLM, num_layers: int) -> None:
        self.target, self.num_layers = target, num_layers

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                 meta: AttentionMetadata) -> torch.Tensor:
        t = self.target
        x, residual = vocab_embedding(t.embed_tokens, input_ids, t.dtype, t.parallel), None
        for i in range(self.num_layers):
            x, residual = t.layers[i](positions, x, residual, kv_caches[i], meta)
        return t.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.target.compute_logits(hidden)


class _Row(NamedTuple):
    request: RequestProgress
    begin: int  # first position run this pass
    end: int  # one past the last


class DraftModelProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, model: DraftLM, kv_caches: list[KVCache],
                 backend: AttentionBackend, block_size: int, max_positions: int, shares_target_kv: bool,
                 device: torch.device | str = "cpu") -> None:
        """``kv_caches``: one (k, v) per draft layer over the target's block ids (for a
        layer-skip draft, the target's own first tensors: ``shares_target_kv``)."""
        super().__init__(num_speculative_tokens)
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.max_positions, self.shares_target_kv = max_positions, shares_target_kv
        self.owns_kv = not shares_target_kv  # its own KV: it tracks every request (lazy catch-up)
        self.catch_up, self.work = CatchUp(), ProposerWork()
        self.device = torch.device(device)
        self.inputs = StepInputBuilder(block_size, 0, self.device)

    def _rows(self, step: ProposerStep) -> list[_Row]:
        """The drafting requests, each from its first position without draft KV to x."""
        rows = []
        for r in step.requests:
            valid = 0 if self.shares_target_kv else self.catch_up.valid(r)
            verified_end = r.start + r.num_verified
            if not (r.wants_drafts and len(r.token_ids) <= min(r.num_slots, self.max_positions)):
                continue
            rows.append(_Row(r, verified_end if self.shares_target_kv else valid, len(r.token_ids)))
            if not self.shares_target_kv:
                self.catch_up.caught_up(r.request_id, verified_end)
        return rows

    def finish(self, request_ids: Iterable[str]) -> None:
        self.catch_up.forget(request_ids)

    def _forward(self, tokens: list[list[int]], rows: list[_Row], starts: list[int]) -> torch.Tensor:
        """Run ``tokens[i]`` at positions ``starts[i]..`` of row i; logits at each row's last token."""
        query_lens = [len(t) for t in tokens]
        seq_lens = [s + q for s, q in zip(starts, query_lens)]
        positions, meta = self.inputs.build(query_lens, seq_lens, [r.request.block_ids for r in rows])
        meta.plan = self.backend.plan(meta)
        ids = torch.tensor([t for ts in tokens for t in ts], dtype=torch.long, device=self.device)
        hidden = self.model(ids, positions, self.kv_caches, meta)
        self.work.add(len(ids))
        last = torch.tensor(query_lens, device=self.device).cumsum(0) - 1
        logits = self.model.compute_logits(hidden.index_select(0, last))
        assert logits is not None, "speculation runs on one rank"
        return logits

    @torch.inference_mode()
    def propose(self, step: ProposerStep) -> dict[str, list[int]]:
        rows = self._rows(step)
        if not rows:
            return {}
        logits = self._forward([r.request.token_ids[r.begin : r.end] for r in rows], rows, [r.begin for r in rows])
        drafts = {r.request.request_id: [t] for r, t in zip(rows, argmax_rows(logits))}
        live = rows
        for i in range(1, self.k):
            # d_i sits at position len(tokens) - 1 + i; it needs a slot and a rotary position
            live = [r for r in live if len(r.request.token_ids) + i <= min(r.request.num_slots, self.max_positions)]
            if not live:
                break
            ids = [[drafts[r.request.request_id][-1]] for r in live]
            logits = self._forward(ids, live, [len(r.request.token_ids) - 1 + i for r in live])
            for r, t in zip(live, argmax_rows(logits)):
                drafts[r.request.request_id].append(t)
        return drafts
