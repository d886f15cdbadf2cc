"""Self-distillation of a draft head on the target's own sequences (CPU, plain torch).

Input: token sequences (prompt + the target's greedy continuation) and the target model.
The target's hidden states h_t come from Treadle's own forward over its paged cache (the
tensor the runner hands the proposers), and the labels are the target's greedy tokens
y_t = argmax lm_head(h_t) (the token after position t), at every position:

    medusa  head k on h_t           -> cross-entropy to y_{t+k+1}
    eagle   (h_t, x_{t+1})          -> g_t: cross-entropy of lm_head(g_t) to y_{t+1}, plus
                                       smooth-L1 of g_t to h_{t+1} (feature regression);
            then an unrolled pass with g_{t-1} in place of h_t, as chained drafting sees it

The target's embedding, final norm and lm_head are frozen float copies (dequantized when the
target is quantized); only the head's tensors train. With a large vocabulary (SmolLM2: 49152)
the cross-entropy runs over the lm_head rows of the tokens that occur as labels (a few
thousand): most of the cost of a step otherwise, and the feature regression keeps the head's
output near the target's hidden state for the other rows.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from treadle.config import ModelConfig
from treadle.layers.attention import StepInputBuilder
from treadle.layers.norm import rms_norm_plain
from treadle.models.llama import LlamaForCausalLM
from treadle.spec_decode.head_format import DRAFT_VOCAB, EagleLayerShape
from treadle.spec_decode.heads import EagleTrainLayer, MedusaHeads


@dataclass(frozen=True)
class FrozenTarget:
    embed: torch.Tensor  # [V, H] float32
    lm_head: torch.Tensor  # [V, H] float32
    norm_weight: torch.Tensor  # [H]
    eps: float

    @staticmethod
    def of(model: LlamaForCausalLM) -> FrozenTarget:
        ids = torch.arange(model.config.vocab_size, device=model.norm.weight.device)
        emb = model.embed_tokens.method.embedding(model.embed_tokens, ids, torch.float32)
        head = emb if model.lm_head is None else model.lm_head.method.embedding(model.lm_head, ids, torch.float32)
        return FrozenTarget(emb, head, model.norm.weight.detach().float().clone(), model.config.rms_norm_eps)


@torch.inference_mode()
def collect_hidden(model: LlamaForCausalLM, seqs: list[list[int]], max_tokens: int = 4096,
                   block_size: int = 16) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sequence: the target's hidden states [T, H] (float32) and greedy labels [T]
    (y_t, the target's argmax after position t), from prefill steps of at most ``max_tokens``."""
    cfg = model.config
    builder = StepInputBuilder(block_size)
    hiddens: list[torch.Tensor] = []
    labels: list[torch.Tensor] = []
    i = 0
    while i < len(seqs):
        batch = [seqs[i]]
        while i + len(batch) < len(seqs) and sum(map(len, batch)) + len(seqs[i + len(batch)]) <= max_tokens:
            batch.append(seqs[i + len(batch)])
        i += len(batch)
        lens = [len(s) for s in batch]
        counts = [-(-n // block_size) for n in lens]
        starts = [sum(counts[:j]) for j in range(len(counts))]
        tables = [list(range(s, s + c)) for s, c in zip(starts, counts)]
        shape = (sum(counts), block_size, cfg.num_kv_heads, cfg.head_dim)
        kv = [(torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
              for _ in range(cfg.num_layers)]
        positions, meta = builder.build(lens, lens, tables)
        meta.plan = model.backend.plan(meta)
        ids = torch.tensor([t for s in batch for t in s], dtype=torch.long)
        hidden = model(ids, positions, kv, meta)
        logits = model.compute_logits(hidden)
        assert logits is not None
        hiddens += [h.float().clone() for h in hidden.split(lens)]
        labels += list(logits.argmax(-1).split(lens))
    return hiddens, labels


@dataclass(frozen=True)
class TrainSettings:
    method: str  # "eagle" | "medusa"
    num_speculative_tokens: int = 4
    steps: int = 300
    batch_tokens: int = 2048  # tokens per step (whole sequences, padded)
    lr: float = 3e-3
    feature_weight: float = 1.0  # eagle: weight of the feature regression
    seed: int = 0
    max_train_vocab: int = 8192  # above it, the cross-entropy runs over the tokens that occur as labels


class _Batch:
    """Padded [B, T] tensors of a few sequences; ``mask`` marks real positions."""

    def __init__(self, idx: list[int], tokens: list[list[int]], hiddens: list[torch.Tensor],
                 labels: list[torch.Tensor]) -> None:
        t = max(len(tokens[i]) for i in idx)
        b, h = len(idx), hiddens[0].shape[-1]
        self.tokens = torch.zeros(b, t, dtype=torch.long)
        self.labels = torch.zeros(b, t, dtype=torch.long)
        self.hidden = torch.zeros(b, t, h)
        self.mask = torch.zeros(b, t, dtype=torch.bool)
        for r, i in enumerate(idx):
            n = len(tokens[i])
            self.tokens[r, :n] = torch.tensor(tokens[i])
            self.labels[r, :n], self.hidden[r, :n], self.mask[r, :n] = labels[i], hiddens[i], True


def _ce(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy, accuracy) over the masked rows."""
    lg, lb = logits[mask], labels[mask]
    return F.cross_entropy(lg, lb), (lg.argmax(-1) == lb).float().mean()


def medusa_loss(heads: MedusaHeads, target: FrozenTarget, batch: _Batch) -> tuple[torch.Tensor, float]:
    feats = heads(batch.hidden)  # [K, B, T, H]
    total, accs = torch.zeros(()), list[float]()
    for k in range(feats.shape[0]):
        shift = k + 1
        if batch.hidden.shape[1] <= shift:
            break
        logits = feats[k, :, :-shift] @ target.lm_head.T
        mask = batch.mask[:, :-shift] & batch.mask[:, shift:]
        loss, acc = _ce(logits, batch.labels[:, shift:], mask)
        total, accs = total + loss, accs + [float(acc)]
    return total, sum(accs) / max(1, len(accs))


def eagle_loss(layer: EagleTrainLayer, target: FrozenTarget, batch: _Batch, unroll: int,
               feature_weight: float) -> tuple[torch.Tensor, float]:
    emb = target.embed[batch.tokens[:, 1:]]  # x_{t+1}
    want = batch.hidden[:, 1:]  # h_{t+1}
    labels, mask = batch.labels[:, 1:], batch.mask[:, 1:]
    hidden = batch.hidden[:, :-1]  # h_t
    total, acc = torch.zeros(()), 0.0
    for step in range(unroll):
        feat, _ = rms_norm_plain(layer(emb, hidden), None, target.norm_weight, target.eps)
        loss, a = _ce(feat @ target.lm_head.T, labels, mask)
        reg = F.smooth_l1_loss(feat[mask], want[mask])
        total = total + loss + feature_weight * reg
        acc = float(a) if step == 0 else acc
        hidden = torch.cat([batch.hidden[:, :1], feat[:, :-1]], 1)  # g_{t-1} stands in for h_t
    return total, acc


def train_head(cfg: ModelConfig, target: FrozenTarget, tokens: list[list[int]], hiddens: list[torch.Tensor],
               labels: list[torch.Tensor], settings: TrainSettings,
               progress: Callable[[int, float, float], None] | None = None) -> dict[str, torch.Tensor]:
    """Train a head; returns its tensors (the file's names; with a large vocabulary also
    ``draft_vocab``, the token ids it was trained over). ``progress(step, loss, acc)``
    is called after every step (acc: the first draft's accuracy on the step's batch)."""
    rows = None
    if cfg.vocab_size > settings.max_train_vocab:  # a large vocabulary: most rows never occur as labels
        rows = torch.unique(torch.cat(labels))
        remap = torch.full((cfg.vocab_size,), -1, dtype=torch.long)
        remap[rows] = torch.arange(rows.numel())
        labels = [remap[lb] for lb in labels]
        target = dataclasses.replace(target, lm_head=target.lm_head[rows])
    gen = torch.Generator().manual_seed(settings.seed)
    torch.manual_seed(settings.seed)
    module: torch.nn.Module
    if settings.method == "medusa":
        module = MedusaHeads(cfg.hidden_size, settings.num_speculative_tokens)
    else:
        module = EagleTrainLayer(cfg, EagleLayerShape.like(cfg))
    opt = torch.optim.AdamW(module.parameters(), lr=settings.lr, weight_decay=0.0)
    warm, steps = max(1, settings.steps // 10), settings.steps
    sched = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, cosine decay
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    order = torch.randperm(len(tokens), generator=gen).tolist()
    cursor = 0
    for step in range(settings.steps):
        idx: list[int] = []
        while not idx or (sum(len(tokens[i]) for i in idx) < settings.batch_tokens and len(idx) < len(tokens)):
            if cursor == len(order):
                order, cursor = torch.randperm(len(tokens), generator=gen).tolist(), 0
            idx.append(order[cursor])
            cursor += 1
        batch = _Batch(idx, tokens, hiddens, labels)
        if isinstance(module, MedusaHeads):
            loss, acc = medusa_loss(module, target, batch)
        else:
            assert isinstance(module, EagleTrainLayer)
            loss, acc = eagle_loss(module, target, batch, 2, settings.feature_weight)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        sched.step()
        if progress is not None:
            progress(step, float(loss.detach()), acc)
    out = {k: v.detach() for k, v in module.state_dict().items()}
    if rows is not None:  # the head was trained to choose among these: the proposer's draft vocabulary
        out[DRAFT_VOCAB] = rows.to(torch.int32)
    return out
