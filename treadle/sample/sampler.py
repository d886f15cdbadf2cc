"""The sampler: logits of the rows that sample this step -> one token each.

Each row is processed on its own (penalties, temperature, top-k/top-p/min-p) and
draws its token by the inverse of its distribution function from one uniform; a
seeded row's uniform comes from a generator derived from (seed, number of tokens
generated so far), so its tokens do not depend on what else is in the batch, on
chunking, or on preemption. Nothing here sorts or draws noise over the whole
vocabulary: at 49,152 tokens those cost milliseconds per row on the CPU.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from treadle.core.step_data import TokenLogprobs
from treadle.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_token_ids: tuple[int, ...]  # EOS + stop_token_ids, masked until min_tokens
    seed_offset: int = 0


def logprobs_at(logprobs: torch.Tensor, token_id: int, top_n: int) -> TokenLogprobs:
    """logprobs [V] -> chosen token's logprob and rank, and the top-n."""
    chosen = float(logprobs[token_id])
    rank = int((logprobs > logprobs[token_id]).sum()) + 1
    top: list[tuple[int, float]] = []
    if top_n > 0:
        values, ids = logprobs.topk(top_n)
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprobs(token_id, chosen, rank, top)


def apply_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """logits [V] -> penalised logits [V] (repetition over prompt+output,
    presence/frequency over output, as in vLLM/OpenAI). Only the tokens seen change, so only
    they are computed (a few hundred entries, not the whole vocabulary)."""
    p, dev = row.params, logits.device
    # Python's Counter and numpy's arrays: torch.unique and torch.tensor(list) of a few hundred
    # ids cost ~0.15 and ~0.09 ms here
    count = Counter(row.output_token_ids)
    out_ids = torch.from_numpy(np.fromiter(count, dtype=np.int64, count=len(count))).to(dev)
    counts = torch.from_numpy(np.fromiter(count.values(), dtype=np.float32, count=len(count))).to(dev, logits.dtype)
    logits = logits.clone()
    if p.repetition_penalty != 1.0:
        seen_ids = count.keys() | set(row.prompt_token_ids)
        seen = torch.from_numpy(np.fromiter(seen_ids, dtype=np.int64, count=len(seen_ids))).to(dev)
        v = logits[seen]
        logits[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if p.frequency_penalty != 0.0:
        logits[out_ids] = logits[out_ids] - p.frequency_penalty * counts
    if p.presence_penalty != 0.0:
        logits[out_ids] = logits[out_ids] - p.presence_penalty
    return logits


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on one row [V]; masked entries -inf."""
    logits = logits / p.temperature
    keep = kept_tokens(logits, p)
    if keep is None:
        return logits
    kept = torch.full_like(logits, float("-inf"))
    kept[keep] = logits[keep]
    return kept


def kept_tokens(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor | None:
    """The tokens top-k, then top-p, then min-p keep of one row of logits [V] (already divided
    by the temperature), in index order; None when every token is kept. Each filter sees the
    distribution the ones before it left (softmax over the kept tokens only)."""
    keep = None
    if 0 < p.top_k < logits.shape[0]:
        keep = torch.nonzero(logits >= _kth_largest(logits, p.top_k)).flatten()
    if p.top_p < 1.0:
        inner = top_p_keep((logits if keep is None else logits[keep]).softmax(-1), p.top_p).sort().values
        keep = inner if keep is None else keep[inner]
    if p.min_p > 0.0:
        probs = (logits if keep is None else logits[keep]).softmax(-1)
        inner = torch.nonzero(probs >= p.min_p * probs.max()).flatten()
        keep = inner if keep is None else keep[inner]
    return keep if keep is None or keep.numel() else None  # NaN logits keep nothing: leave them all


def _kth_largest(x: torch.Tensor, k: int) -> float:
    if x.device.type == "cpu" and not x.requires_grad:  # numpy's partition: ~2x torch.topk's speed here
        a = x.float().numpy()
        return float(np.partition(a, a.shape[0] - k)[a.shape[0] - k])
    return float(torch.topk(x, k).values[-1])


TOP_P_TAIL = 2.0**-12  # top-p first looks among the tokens at least this fraction as likely as the first
TOP_P_CANDIDATES = 4096  # ... when there are at most this many


def top_p_keep(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Indices of the smallest set of most likely tokens whose probabilities reach top_p: in
    order of probability, highest first (equal ones in index order, as a stable sort), a token
    is kept while the ones before it sum to at most top_p. No sort of all of probs [V] with its
    indices (~2-6 ms for 49,152 on the CPU, numpy or torch): first among the tokens at least
    TOP_P_TAIL times as likely as the most likely one, which decide when the set ends among
    them (every token left out is less likely than all of them); else from the sorted values
    alone (~0.5 ms): the cut value, every token above it and, in index order, as many of its
    ties as the rule keeps."""
    p = probs.detach().float().cpu().numpy()
    cand = np.flatnonzero(p >= p.max() * np.float32(TOP_P_TAIL))
    if cand.size <= TOP_P_CANDIDATES:
        cand = cand[np.lexsort((cand, -p[cand]))]
        n_keep = _top_p_count(p[cand], top_p)
        if n_keep < cand.size:
            return torch.from_numpy(cand[:n_keep]).to(probs.device)
    values = np.sort(p)[::-1]
    n_keep = _top_p_count(values, top_p)
    cut = values[n_keep - 1]
    above = np.flatnonzero(p > cut)
    ties = np.flatnonzero(p == cut)[: n_keep - above.size]
    return torch.from_numpy(np.concatenate([above, ties])).to(probs.device)


def _top_p_count(values: np.ndarray, top_p: float) -> int:
    """How many of values (float32, highest first) top-p keeps: a running sum accumulated in
    float64 and rounded to float32, as torch's CPU cumsum does."""
    before = np.cumsum(values, dtype=np.float64).astype(np.float32) - values
    drop = before > np.float32(top_p)
    return int(drop.argmax()) if drop.any() else values.size


def argmax_rows(x: torch.Tensor) -> list[int]:
    """The index of the maximum of each row of x [N, V] (of x itself when [V]; the first on
    ties), as Python ints. Float CPU tensors go through numpy: torch's CPU argmax is ~6x slower
    (94 vs 14 us for one 49,152-wide row, 713 vs 176 us for 16, AMD Zen 1)."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and not x.requires_grad:
        return np.atleast_1d(x.numpy().argmax(-1)).tolist()
    return x.argmax(-1).reshape(-1).tolist()


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits [num_rows, V] float32 -> (token per row, logprobs per row or None)."""
        plain_greedy = all(
            r.params.greedy and not r.params.needs_penalties and r.params.logprobs is None
            and len(r.output_token_ids) >= r.params.min_tokens
            for r in rows
        )
        if plain_greedy:  # fast path: one argmax over the batch
            return argmax_rows(logits), [None] * len(rows)
        tokens: list[int] = []
        logprobs: list[TokenLogprobs | None] = []
        for i, row in enumerate(rows):
            tokens.append(self.sample_row(logits[i], row))
            n = row.params.logprobs
            logprobs.append(None if n is None else logprobs_at(logits[i].log_softmax(-1), tokens[-1], n))
        return tokens, logprobs

    def sample_row(self, logits: torch.Tensor, row: SamplingRow) -> int:
        """One row's token: logits [V] after every sampling parameter, argmax when greedy."""
        logits = processed_logits(logits, row)
        if row.params.greedy:
            return argmax_rows(logits)[0]
        logits = logits / row.params.temperature
        keep = kept_tokens(logits, row.params)
        if keep is None:
            return self.draw(logits.softmax(-1), row)
        # among the kept tokens only (in index order, so a given uniform picks what it would over all V)
        return int(keep[self.draw(logits[keep].softmax(-1), row)])

    def target_probs(self, logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
        """The distribution a non-greedy row samples from: logits [V] -> probs [V] after
        penalties, min_tokens, temperature, top-k/top-p/min-p (the verifier's p)."""
        return filter_logits(processed_logits(logits, row), row.params).softmax(-1)

    def draw(self, probs: torch.Tensor, row: SamplingRow) -> int:
        """A token from probs [V] (which may be unnormalised) by the inverse of its distribution
        function: the first token whose running sum (float64) passes u times the total, one
        u ~ U[0, 1) per draw, a seeded row's from (seed, tokens generated so far). A token of
        probability 0 is never drawn. (One uniform instead of V exponentials: ~0.2 ms instead of
        ~2 ms for 49,152 tokens on the CPU.)"""
        cdf = probs.double().cumsum(0)
        total = float(cdf[-1])
        if not total > 0.0:  # nothing to draw from (all zero, or NaN): the largest entry
            return argmax_rows(probs)[0]
        target = torch.tensor([self._uniform(row, 0) * total], dtype=torch.float64, device=cdf.device)
        return min(int(torch.searchsorted(cdf, target, right=True)), probs.shape[0] - 1)

    def uniform(self, row: SamplingRow) -> float:
        """One U(0, 1) draw for an accept test: a seeded row's from (seed, tokens generated so
        far), apart from the one ``draw`` uses at the same position."""
        return self._uniform(row, 1)

    def _uniform(self, row: SamplingRow, use: int) -> float:
        if row.params.seed is None:
            return float(torch.rand((), generator=self.generator, dtype=torch.float64))
        step_seed = hash((row.params.seed + row.seed_offset, len(row.output_token_ids), use))  # ints: hash() is stable
        return float(torch.rand((), generator=torch.Generator().manual_seed(step_seed & 0x7FFF_FFFF_FFFF_FFFF),
                                dtype=torch.float64))


def processed_logits(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """logits [V] -> penalised logits [V] with EOS / stop ids masked until min_tokens."""
    p = row.params
    if p.needs_penalties:
        logits = apply_penalties(logits, row)
    if len(row.output_token_ids) < p.min_tokens and row.stop_token_ids:
        logits = logits.clone()
        logits[list(row.stop_token_ids)] = float("-inf")
    return logits
