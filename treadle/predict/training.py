"""Fitting a length predictor on (prompt, true output length) pairs, and Kendall's tau.

Loss (full batch, gradient descent with momentum, CPU):

    pairwise:  mean over pairs (i, j) with len_i > len_j of softplus(-(s_i - s_j))   (RankNet)
    anchor:    ANCHOR * mean (s_i - log1p(len_i))^2

The ranking term is what the scheduler needs (who is shorter); the small anchor keeps the
score on the log-length scale, so ``expm1(score)`` is a usable token count for
``predicted_remaining = predicted - generated``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from treadle.predict.model import LOG_LEN_SCALE, LengthPredictor, PredictorConfig, bucket_ids

ANCHOR = 0.3
BAG_LR_SCALE = 10.0


@dataclass(frozen=True)
class FitSettings:
    steps: int = 400
    lr: float = 0.3
    weight_decay: float = 1e-3
    seed: int = 0


def kendall_tau(x: Sequence[float], y: Sequence[float]) -> float:
    """Kendall's tau-b of two sequences (ties counted as in scipy's default)."""
    a, b = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    da = np.sign(a[:, None] - a[None, :])
    db = np.sign(b[:, None] - b[None, :])
    iu = np.triu_indices(len(a), 1)
    da, db = da[iu], db[iu]
    concordant_minus_discordant = float((da * db).sum())
    denom = math.sqrt(float((da != 0).sum()) * float((db != 0).sum()))
    return concordant_minus_discordant / denom if denom else 0.0


def fit(prompts: Sequence[Sequence[int]], lengths: Sequence[int], config: PredictorConfig,
        settings: FitSettings = FitSettings()) -> LengthPredictor:
    """Train the linear n-gram model on ``prompts`` (token ids) and their true output lengths."""
    import torch

    torch.manual_seed(settings.seed)
    feats = [bucket_ids(p, config.num_buckets, config.orders) for p in prompts]
    offsets = torch.tensor([0] + [len(f) for f in feats[:-1]]).cumsum(0)
    flat = torch.from_numpy(np.concatenate(feats)) if feats else torch.zeros(0, dtype=torch.int64)
    norm = torch.cat([torch.full((len(f),), 1.0 / math.sqrt(len(f))) for f in feats if len(f)])  # as model.score
    log_len = torch.tensor([math.log1p(n) for n in lengths], dtype=torch.float32)
    log_prompt = torch.tensor([math.log1p(len(p)) / LOG_LEN_SCALE for p in prompts], dtype=torch.float32)
    bag = torch.nn.EmbeddingBag(config.num_buckets, 1, mode="sum")
    torch.nn.init.zeros_(bag.weight)
    extra = torch.nn.Parameter(torch.tensor([0.0, float(log_len.mean())]))
    # plain full-batch gradient descent, not Adam: Adam scales each weight's step alike, so the rare
    # n-grams (topic words, seen once) would be fitted as fast as the common instruction n-grams
    # the n-gram weights each see a small share of the loss: they take a larger step than the two dense ones
    groups: list[dict[str, Any]] = [{"params": [bag.weight], "lr": settings.lr * BAG_LR_SCALE}, {"params": [extra]}]
    opt = torch.optim.SGD(groups, lr=settings.lr, momentum=0.5, weight_decay=settings.weight_decay)
    longer = (log_len[:, None] > log_len[None, :]).float()  # [n, n]: 1 where i is longer than j
    num_pairs = max(1.0, float(longer.sum()))
    for _ in range(settings.steps):
        score = bag(flat, offsets, per_sample_weights=norm).squeeze(1) + extra[0] * log_prompt + extra[1]
        diff = score[:, None] - score[None, :]
        rank_loss = (torch.nn.functional.softplus(-diff) * longer).sum() / num_pairs
        loss = rank_loss + ANCHOR * ((score - log_len) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return LengthPredictor(config, bag.weight.detach().squeeze(1).numpy().copy(), extra.detach().numpy().copy())
