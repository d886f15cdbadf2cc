"""The verifier: one request's target logits at its 1 + K verify rows and its K drafts ->
the accepted drafts plus one more token, exactly as plain decoding would produce them.

    rows:    0          1          ...   K
    input:   last tok   d1         ...   dK
    p_j:     p(.|..)    p(.|..d1)  ...   p(.|..dK)       (after every sampling parameter,
                                                          penalties counting d1..dj as output)
    j < K:   accept d_{j+1}?  yes -> go on;  no -> emit a correction from row j, stop
    j = K:   every draft accepted -> a bonus token from row K

- Greedy: accept while the draft is the argmax; the correction / bonus is the argmax. The
  output is token for token the non-speculative greedy output.
- Sampling, draft distribution q given (a draft model): accept x with probability
  min(1, p(x) / q(x)); on rejection draw from norm(max(p - q, 0)).
- Sampling, q a point mass on x (n-gram): then accept with p(x) and, on rejection, draw from
  p without x. Drawing y ~ p as plain sampling does (``Sampler.sample_row``: the same
  computation, the row's own uniform) and accepting iff y == x is exactly that (P[accept] = p(x);
  given a rejection, y ~ p restricted to tokens != x): a seeded request gives the same tokens with
  or without n-gram drafts.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from treadle.core.step_data import TokenLogprobs
from treadle.sample.sampler import Sampler, SamplingRow, logprobs_at


class Verified(NamedTuple):
    tokens: list[int]  # accepted drafts, then the correction or bonus token (1 .. K+1 tokens)
    logprobs: list[TokenLogprobs] | None  # per emitted token, when the request asks for them


def _row_at(row: SamplingRow, drafts: list[int], j: int) -> SamplingRow:
    """The sampling row at verify position j: drafts d1..dj count as generated output."""
    return dataclasses.replace(row, output_token_ids=row.output_token_ids + drafts[:j]) if j else row


def verify(
    sampler: Sampler,
    logits: torch.Tensor,  # [K + 1, V] float32, the target's logits at the verify rows
    row: SamplingRow,
    drafts: list[int],  # [K]
    draft_probs: torch.Tensor | None = None,  # [K, V] q, or None for a point mass (n-gram)
) -> Verified:
    tokens: list[int] = []
    for j in range(len(drafts) + 1):
        at = _row_at(row, drafts, j)
        draft = drafts[j] if j < len(drafts) else None
        if at.params.greedy or draft is None or draft_probs is None:
            token = sampler.sample_row(logits[j], at)  # plain sampling's own computation: the same token
        else:
            token = _accept_or_resample(sampler, sampler.target_probs(logits[j], at), draft_probs[j], draft, at)
        tokens.append(token)
        if token != draft:
            break
    n = row.params.logprobs
    lps = None if n is None else [logprobs_at(logits[j].log_softmax(-1), t, n) for j, t in enumerate(tokens)]
    return Verified(tokens, lps)


def _accept_or_resample(sampler: Sampler, p: torch.Tensor, q: torch.Tensor, draft: int, row: SamplingRow) -> int:
    """min(1, p(x)/q(x)) acceptance; a rejection draws from norm(max(p - q, 0))."""
    px, qx = float(p[draft]), float(q[draft])
    if qx > 0 and sampler.uniform(row) * qx < px:
        return draft
    residual = (p - q).clamp_min(0)
    if float(residual.sum()) <= 0:  # p == q: a rejection has probability 0; p is its limit
        residual = p
    return sampler.draw(residual, row)
