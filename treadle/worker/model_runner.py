"""The Text Generator's model runner: a SchedulerOutput becomes one flat batch
(token ids, positions, block tables, slot mapping), the model runs once, and
the rows that reached their end are sampled.

After loading, the runner swaps in fused decoder layers where it can (CPU fast path,
``fused_layers``); each step it builds the inputs with one ``StepInputBuilder`` and asks the
attention backend for its per-step plan once (``AttentionBackend.plan``).

The runner keeps a copy of each live request's tokens (sent once, when new)
and appends what it samples, so the scheduler sends only progress and blocks. Under
pipeline parallelism only the sampling rank (last stage) appends what it samples; the other
ranks append the tokens each ScheduledRequest carries (``new_token_ids``), so no stage
waits on a collective for another step's tokens (the engine's batch queue needs that).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from treadle.config import ModelConfig
from treadle.core.kv_groups import KVGroups
from treadle.core.step_data import ModelRunnerOutput, NewRequestData, SchedulerOutput, TokenLogprobs
from treadle.distributed import ParallelContext
from treadle.distributed.overlap import split_tokens
from treadle.layers.attention import AttentionBackend, AttentionMetadata, StepInputBuilder
from treadle.layers.attention.kv_quant import row_width
from treadle.models.llama import LlamaForCausalLM
from treadle.sample.rejection_sampler import verify
from treadle.sample.sampler import Sampler, SamplingRow, logprobs_at
from treadle.spec_decode.proposer import Proposer, ProposerStep, RequestProgress
from treadle.structured.matchers import GrammarMatchers
from treadle.worker.cuda_graph import CUDAGraphRunner
from treadle.worker.fused_layers import fuse_decoder_layers


@dataclass
class CachedRequestState:
    data: NewRequestData
    output_token_ids: list[int] = field(default_factory=list)

    def token_slice(self, start: int, end: int) -> list[int]:
        prompt = self.data.prompt_token_ids
        if end <= len(prompt):
            return prompt[start:end]
        return (prompt + self.output_token_ids)[start:end]

    @property
    def num_tokens(self) -> int:
        return len(self.data.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.data.prompt_token_ids + self.output_token_ids

    def sampling_row(self) -> SamplingRow:
        p = self.data.sampling_params
        stops = tuple(dict.fromkeys((*self.data.eos_token_ids, *p.stop_token_ids)))
        return SamplingRow(p, self.data.prompt_token_ids, self.output_token_ids, stops, self.data.seed_offset)


@dataclass
class BatchInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    sample_rows: list[tuple[str, int]]  # (request id, flat index of its last token), requests without drafts
    verify_rows: list[tuple[str, int, list[int]]]  # (request id, flat index of its last real token, drafts)
    prompt_rows: list[tuple[str, int, int, int]]  # (request id, flat start, first position, count)
    micro: list[tuple[torch.Tensor, AttentionMetadata]] | None = None  # overlap: (positions, meta) per half


def allocate_kv_cache(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str,
    layers: range | None = None, groups: KVGroups | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k, v) pair per layer; ``cfg`` is the rank's (its KV heads). Layers outside
    ``layers`` (another pipeline stage's) get empty tensors. A quantized ``dtype`` (int8,
    float8_e4m3fn) holds each row's scale after its values (``layers.attention.kv_quant``).
    Hybrid ``groups`` (``core/kv_groups.py``): ``group_size`` pairs, layer l gets pair
    ``slot_of(l)`` (one block id names rows of one group's layers)."""
    layers = range(cfg.num_layers) if layers is None else layers

    def pair(blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (blocks, block_size, cfg.num_kv_heads, row_width(cfg.head_dim, dtype))
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)

    if groups is None or not groups.hybrid:
        return [pair(num_blocks if i in layers else 0) for i in range(cfg.num_layers)]
    slots = [groups.slot_of(i) for i in range(cfg.num_layers)]
    pairs = {slot: pair(num_blocks) for slot in sorted({slots[i] for i in layers})}
    return [pairs[slots[i]] if i in layers else pair(0) for i in range(cfg.num_layers)]


class ModelRunner:
    """Owns the model, its KV cache and the step-input buffers. ``fused_layers`` (CPU): swap
    the decoder layers the one-call C layer can run (``treadle.worker.fused_layers``)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        max_num_batched_tokens: int,
        device: torch.device | str = "cpu",
        seed: int = 0,
        graphs: CUDAGraphRunner | None = None,
        fused_layers: bool = True,
        parallel: ParallelContext | None = None,
        overlap: bool = False,
        proposer: Proposer | None = None,
        grammars: GrammarMatchers | None = None,
        kv_groups: KVGroups | None = None,
    ) -> None:
        """``kv_groups``: the layers' KV groups (hybrid: each group's layers read its own block
        tables, ``ScheduledRequest.group_block_ids``; None: one group). ``overlap`` (tensor parallelism without pipeline stages): cut each step of two or
        more tokens into two micro-batches whose all-reduces overlap compute. ``grammars``:
        structured output (None: the model has no tokenizer, so no request can be constrained).
        ``proposer``: speculative decoding (``treadle.worker.proposers.build_proposer``)."""
        self.model = model
        self.parallel = parallel or ParallelContext.single(model.config.vocab_size)
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device)
        self.sampler = Sampler(seed)
        self.graphs = graphs  # replays captured decode steps on CUDA
        self.grammars = grammars
        self.requests: dict[str, CachedRequestState] = {}
        self.backend: AttentionBackend = model.backend
        self.proposer = proposer
        if fused_layers and self.device.type == "cpu":
            fuse_decoder_layers(model)
        # persistent host buffers, reused every step
        self.inputs = StepInputBuilder(block_size, max_num_batched_tokens, self.device)
        self.overlap = overlap and self.parallel.tp_size > 1 and self.parallel.pp_size == 1
        self._micro_inputs = [StepInputBuilder(block_size, max_num_batched_tokens, self.device) for _ in range(2)]
        self._ids = np.zeros(max_num_batched_tokens, dtype=np.int64)
        groups = kv_groups or KVGroups.single(model.config.num_layers)
        self._layer_group = [groups.group_of(i) for i in range(groups.num_layers)] if groups.hybrid else None
        self._group_inputs = [StepInputBuilder(block_size, max_num_batched_tokens, self.device)
                              for _ in groups.groups[1:]]

    def _prepare(self, sched: SchedulerOutput) -> BatchInputs:
        n_tok = sched.total_num_scheduled_tokens
        if n_tok > self._ids.shape[0]:
            self._ids = np.zeros(n_tok, dtype=np.int64)
        query_lens, seq_lens, tables = [], [], []
        group_tables: list[list[list[int]]] = [[] for _ in self._group_inputs]
        sample_rows: list[tuple[str, int]] = []
        verify_rows: list[tuple[str, int, list[int]]] = []
        prompt_rows: list[tuple[str, int, int, int]] = []
        cursor = 0
        for s in sched.scheduled:
            state = self.requests[s.request_id]
            start, n = s.num_computed_tokens, s.num_scheduled_tokens
            drafts = s.draft_token_ids
            real = n - len(drafts)  # drafts sit after the request's real tokens
            self._ids[cursor : cursor + real] = state.token_slice(start, start + real)
            self._ids[cursor + real : cursor + n] = drafts
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(s.block_ids)
            for g, ids in enumerate(s.group_block_ids):
                group_tables[g].append(ids)
            if start + real == state.num_tokens:
                if drafts:
                    verify_rows.append((s.request_id, cursor + real - 1, drafts))
                else:
                    sample_rows.append((s.request_id, cursor + n - 1))
            n_prompt = len(state.data.prompt_token_ids)
            if state.data.sampling_params.prompt_logprobs is not None and start < n_prompt:
                prompt_rows.append((s.request_id, cursor, start, min(n, n_prompt - start)))
            cursor += n
        positions, meta = self.inputs.build(query_lens, seq_lens, tables)
        meta.plan = self.backend.plan(meta)  # once per step, read by every layer
        if self._layer_group is not None:
            meta.layer_meta = self._layer_meta(meta, query_lens, seq_lens, group_tables)
        input_ids = torch.from_numpy(self._ids[:cursor]).to(self.device)
        batch = BatchInputs(input_ids, positions, meta, sample_rows, verify_rows, prompt_rows)
        if self.overlap and cursor >= 2 and self._layer_group is None:
            batch.micro = []
            for builder, part in zip(self._micro_inputs, split_tokens(query_lens, seq_lens, tables, cursor // 2)):
                pos, micro_meta = builder.build(*part)
                micro_meta.plan = self.backend.plan(micro_meta)
                batch.micro.append((pos, micro_meta))
        return batch

    def _layer_meta(self, meta: AttentionMetadata, query_lens: list[int], seq_lens: list[int],
                    group_tables: list[list[list[int]]]) -> list[AttentionMetadata]:
        """Hybrid KV: each layer's metadata, its group's tables over the step's tokens (planned once per group)."""
        metas = [meta]
        for builder, tables in zip(self._group_inputs, group_tables):
            group_meta = builder.build(query_lens, seq_lens, tables).meta
            group_meta.plan = self.backend.plan(group_meta)
            metas.append(group_meta)
        assert self._layer_group is not None
        return [metas[g] for g in self._layer_group]

    def forward(self, batch: BatchInputs) -> torch.Tensor | None:  # [num_tokens, hidden_size]
        """Run the model over a prepared step (a captured CUDA graph when one fits). Under
        pipeline parallelism a stage receives the previous stage's carry and sends its own to
        the next; only the last stage returns hidden states (None elsewhere)."""
        if (self.graphs is not None and batch.meta.wait_for_layer is None and batch.meta.layer_meta is None
                and self.graphs.can_run(batch.meta)):
            return self.graphs.run(batch.input_ids, batch.positions, batch.meta)
        par = self.parallel
        if batch.micro is not None:
            return self.model.forward_overlapped(batch.input_ids, batch.micro, self.kv_caches)
        if par.pp_size == 1:
            return self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        carry = None
        if not par.is_first_stage:
            cfg = self.model.config
            carry = par.recv_carry(batch.input_ids.shape[0], cfg.hidden_size, self.model.dtype, self.device)
        out = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta, carry)
        if par.is_last_stage:
            return out
        par.send_carry(out)
        return None

    def _update_states(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_request_ids:
            self.requests.pop(rid, None)
            if self.grammars is not None:
                self.grammars.remove(rid)
        if self.proposer is not None:
            self.proposer.finish(sched.finished_request_ids)
        for new in sched.new_requests:
            self.requests[new.request_id] = CachedRequestState(new)
            spec = new.sampling_params.structured_outputs
            if spec is not None and self.grammars is not None:
                stops = dict.fromkeys((*new.eos_token_ids, *new.sampling_params.stop_token_ids))
                self.grammars.add(new.request_id, spec, list(stops))
        if self.parallel.pp_size > 1 and not self.parallel.is_sampling_rank:
            for s in sched.scheduled:
                self.requests[s.request_id].output_token_ids.extend(s.new_token_ids)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, wait_for_layer: Callable[[int], None] | None = None) -> ModelRunnerOutput:
        """``wait_for_layer`` (P/D layer-wise start): called before each layer runs, on a step
        one of whose requests still receives its KV (no CUDA graph, no micro-batches then)."""
        self._update_states(sched)
        if sched.is_empty:
            return ModelRunnerOutput(sampled={})
        batch = self._prepare(sched)
        if wait_for_layer is not None:
            batch.meta.wait_for_layer, batch.micro = wait_for_layer, None
        hidden = self.forward(batch)
        result = ModelRunnerOutput(sampled={})
        if hidden is not None and batch.prompt_rows:
            result.prompt_logprobs = self._prompt_logprobs(hidden, batch)
        if batch.sample_rows:
            states = [self.requests[rid] for rid, _ in batch.sample_rows]
            constrained = self.grammars is not None and self.grammars.active
            sampled, logprobs = self._sample(hidden, batch, states, constrained)
            for state, token, lp in zip(states, sampled or [], logprobs):
                rid = state.data.request_id
                if constrained and self.grammars is not None:
                    self.grammars.accept(rid, token)
                state.output_token_ids.append(token)
                result.sampled[rid] = [token]
                if lp is not None:
                    result.logprobs[rid] = [lp]
        if batch.verify_rows and hidden is not None:  # speculation runs on one rank (resolver)
            self._verify(hidden, batch.verify_rows, result)
        if self.proposer is not None and hidden is not None and (
                self.proposer.owns_kv or any(s.propose for s in sched.scheduled)):
            result.draft_token_ids = self.proposer.propose(self._proposer_step(sched, hidden, result))
        return result

    def _proposer_step(self, sched: SchedulerOutput, hidden: torch.Tensor, result: ModelRunnerOutput) -> ProposerStep:
        """What the proposer sees of this step (``spec_decode.proposer``)."""
        progress, cursor = [], 0
        for s in sched.scheduled:
            rid, state, sampled = s.request_id, self.requests[s.request_id], result.sampled.get(s.request_id)
            n = s.num_scheduled_tokens
            verified = n if sampled is None else n - len(s.draft_token_ids) + len(sampled) - 1
            # a constrained request gets no drafts: it decodes one masked token per step
            wants = sampled is not None and s.propose and (self.grammars is None or not self.grammars.constrains(rid))
            drafts = len(s.draft_token_ids) if sampled is not None else 0
            progress.append(RequestProgress(rid, state.all_token_ids, s.block_ids, s.num_computed_tokens, verified,
                                            cursor, wants, len(s.block_ids) * self.block_size, drafts,
                                            len(sampled) - 1 if drafts and sampled else 0))
            cursor += n
        return ProposerStep(progress, hidden)

    def _verify(self, hidden: torch.Tensor, rows: list[tuple[str, int, list[int]]], result: ModelRunnerOutput) -> None:
        """Logits at each speculating request's 1 + K rows (one matmul), then the verifier."""
        index = torch.cat([torch.arange(i, i + len(d) + 1) for _, i, d in rows]).to(hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))
        assert logits is not None, "speculation runs on one rank, which samples"
        at = 0
        for rid, _, drafts in rows:
            state = self.requests[rid]
            q = None if self.proposer is None else self.proposer.draft_probs(rid, len(drafts))
            out = verify(self.sampler, logits[at : at + len(drafts) + 1], state.sampling_row(), drafts, q)
            at += len(drafts) + 1
            state.output_token_ids.extend(out.tokens)
            result.sampled[rid] = out.tokens
            if out.logprobs is not None:
                result.logprobs[rid] = out.logprobs

    def _sample(self, hidden: torch.Tensor | None, batch: BatchInputs, states: list[CachedRequestState],
                constrained: bool = False) -> tuple[list[int] | None, list[TokenLogprobs | None]]:
        """Tokens (and logprobs) of the sampled rows. The sampling rank (the last) samples;
        the other ranks of its stage help gather the logits, and every other rank gets the
        tokens by broadcast (its copy of each request's tokens stays in step) -- except under
        pipeline parallelism, where they come with the next schedule and this returns None
        off the sampling rank."""
        tokens: list[int] | None = None
        logprobs: list[TokenLogprobs | None] = [None] * len(states)
        if hidden is not None:
            index = torch.tensor([i for _, i in batch.sample_rows], device=hidden.device)
            logits = self.model.compute_logits(hidden.index_select(0, index))
            if logits is not None:
                if constrained and self.grammars is not None:  # grammar-forbidden tokens -> -inf
                    self.grammars.mask(logits, [rid for rid, _ in batch.sample_rows])
                tokens, logprobs = self.sampler(logits, [s.sampling_row() for s in states])
        if self.parallel.pp_size > 1:
            return tokens, logprobs
        return self.parallel.broadcast_tokens(tokens, len(states)), logprobs

    def _prompt_logprobs(self, hidden: torch.Tensor,
                         batch: BatchInputs) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """Logprob of each prompt token given the ones before it, for this chunk, with the
        position of the first token scored. The chunk's row at position p scores prompt token p + 1."""
        out: dict[str, tuple[int, list[TokenLogprobs]]] = {}
        for rid, flat_start, first_pos, count in batch.prompt_rows:
            state = self.requests[rid]
            prompt = state.data.prompt_token_ids
            top_n = state.data.sampling_params.prompt_logprobs or 0
            count = min(count, len(prompt) - 1 - first_pos)  # the last prompt row predicts output
            if count <= 0:
                out[rid] = (first_pos + 1, [])
                continue
            logits = self.model.compute_logits(hidden[flat_start : flat_start + count])
            if logits is None:  # another rank samples
                continue
            lps = logits.log_softmax(-1)
            out[rid] = (first_pos + 1, [logprobs_at(lps[j], prompt[first_pos + j + 1], top_n) for j in range(count)])
        return out
