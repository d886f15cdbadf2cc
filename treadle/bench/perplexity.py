"""Perplexity of a model on a text, and how far its logits are from a reference model's.

Method (``treadle eval perplexity``): the text is tokenized once (with the tokenizer's
special tokens, so a BOS is prepended where the model expects one) and cut into windows of
``window`` tokens that start every ``stride`` tokens:

    tokens   t0 t1 t2 ............................................ tN-1
    window 1 [t0 ....................... t(W-1)]            scores t1 .. t(W-1)
    window 2            [t(S) ....................... t(S+W-1)]  scores only the tokens
    window 3                       [t(2S) ........ ]             window 2 did not score

Each window is one fresh sequence, prefilled in one step through the model's paged KV
cache and attention backend (the engine's own forward and quantized kernels, called
directly: the metrics need the full logits, which the engine does not return). Every
token after the first is scored exactly once, with at least W - S tokens of context
except in the first window. perplexity = exp(mean NLL). Against a reference model on the
same windows: top-1 agreement (argmax equal) and mean |logit - reference logit| over the
scored positions and the whole vocabulary.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from treadle.layers.attention import StepInputBuilder
from treadle.loaders import LoadedModel

BLOCK_SIZE = 16


@dataclass(frozen=True)
class PerplexityResult:
    tokens_scored: int
    perplexity: float
    top1_agreement: float | None  # fraction of scored positions whose argmax equals the reference's
    mean_abs_dlogit: float | None
    weight_mb: float
    decode_ms: float  # median decode step, batch 1, after a 64-token prompt


def windows(num_tokens: int, window: int, stride: int) -> Iterator[tuple[int, int, int]]:
    """(begin, end, first scored position) of each window; positions are scored once."""
    scored_to = 1  # position 0 has no prediction
    for begin in range(0, num_tokens - 1, stride):
        end = min(begin + window, num_tokens)
        if end > scored_to:
            yield begin, end, scored_to
            scored_to = end
        if end == num_tokens:
            break


class SequenceRunner:
    """One sequence at a time through a loaded model's paged forward."""

    def __init__(self, lm: LoadedModel, max_len: int) -> None:
        cfg = lm.config
        self.model = lm.model
        blocks = -(-max_len // BLOCK_SIZE)
        shape = (blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
        self.caches = [(torch.zeros(shape, dtype=lm.model.dtype), torch.zeros(shape, dtype=lm.model.dtype))
                       for _ in range(cfg.num_layers)]
        self.table = [list(range(blocks))]
        self.inputs = StepInputBuilder(BLOCK_SIZE)
        self.length = 0

    @torch.no_grad()
    def feed(self, tokens: list[int], restart: bool = False) -> torch.Tensor:  # [len(tokens), vocab] float32
        if restart:
            self.length = 0
        n = self.length + len(tokens)
        positions, meta = self.inputs.build([len(tokens)], [n], self.table)
        meta.plan = self.model.backend.plan(meta)
        hidden = self.model(torch.tensor(tokens, dtype=torch.long), positions, self.caches, meta)
        self.length = n
        logits = self.model.compute_logits(hidden)
        assert logits is not None
        return logits.float()


def weight_megabytes(lm: LoadedModel) -> float:
    """Bytes of every parameter and buffer (each storage once), rotary tables left out."""
    seen, total = set(), 0
    for name, t in [*lm.model.named_parameters(), *lm.model.named_buffers()]:
        if "cos_sin" in name or t.untyped_storage().data_ptr() in seen:
            continue
        seen.add(t.untyped_storage().data_ptr())
        total += t.untyped_storage().nbytes()
    return total / 2**20


def decode_step_ms(lm: LoadedModel, prompt: list[int], steps: int = 16) -> float:
    runner = SequenceRunner(lm, len(prompt) + steps + 1)
    last = runner.feed(prompt, restart=True)[-1]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        last = runner.feed([int(last.argmax())])[-1]
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


@torch.no_grad()
def evaluate(lm: LoadedModel, ids: list[int], window: int, stride: int,
             reference: LoadedModel | None = None) -> PerplexityResult:
    """Perplexity of ``lm`` on ``ids`` (see the module docstring), compared with ``reference``."""
    runner = SequenceRunner(lm, window)
    ref_runner = SequenceRunner(reference, window) if reference is not None else None
    nll, agree, dlogit, count = 0.0, 0, 0.0, 0
    for begin, end, first in windows(len(ids), window, stride):
        rows = slice(first - 1 - begin, end - 1 - begin)  # logits at p - 1 predict token p
        logits = runner.feed(ids[begin:end], restart=True)[rows]
        targets = torch.tensor(ids[first:end])
        nll += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
        count += len(targets)
        if ref_runner is not None:
            ref = ref_runner.feed(ids[begin:end], restart=True)[rows]
            agree += int((logits.argmax(-1) == ref.argmax(-1)).sum())
            dlogit += float((logits - ref).abs().mean(-1).sum())
    return PerplexityResult(
        tokens_scored=count,
        perplexity=float(torch.exp(torch.tensor(nll / count))),
        top1_agreement=agree / count if ref_runner is not None else None,
        mean_abs_dlogit=dlogit / count if ref_runner is not None else None,
        weight_mb=weight_megabytes(lm),
        decode_ms=decode_step_ms(lm, ids[:64]),
    )
