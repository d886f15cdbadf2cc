"""Perplexity of a model on a text, and how far its logits are from a reference model's.

Method (``treadle eval perplexity``): the text is tokenized once (with the tokenizer's
special tokens, so a BOS is prepended where the model expects one) and cut into windows of
``window`` tokens that start every ``stride`` tokens (default: stride = window - 1, windows
side by side overlapping by the one token a window cannot predict; a smaller stride gives
later windows more context at more cost):

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
from treadle.layers.attention.kv_quant import cache_dtype
from treadle.loaders import LoadedModel
from treadle.worker.model_runner import allocate_kv_cache

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
    """(begin, end, first scored position) of each window; positions are scored once. The
    step is at most ``window - 1``: a window's first token has no prediction inside it, so
    consecutive windows overlap by at least one token."""
    scored_to = 1  # position 0 has no prediction
    for begin in range(0, num_tokens - 1, min(stride, window - 1)):
        end = min(begin + window, num_tokens)
        if end > scored_to:
            yield begin, end, scored_to
            scored_to = end
        if end == num_tokens:
            break


class SequenceRunner:
    """One sequence at a time through a loaded model's paged forward, its KV cache in
    ``kv_cache_dtype`` ("auto": the model's dtype; "int8" / "fp8" as ``--kv-cache-dtype``)."""

    def __init__(self, lm: LoadedModel, max_len: int, kv_cache_dtype: str = "auto") -> None:
        cfg = lm.config
        self.model = lm.model
        blocks = -(-max_len // BLOCK_SIZE)
        dtype = lm.model.dtype if kv_cache_dtype == "auto" else cache_dtype(kv_cache_dtype)
        self.caches = allocate_kv_cache(cfg, blocks, BLOCK_SIZE, dtype, "cpu")
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


def decode_step_ms(lm: LoadedModel, prompt: list[int], steps: int = 16, kv_cache_dtype: str = "auto") -> float:
    runner = SequenceRunner(lm, len(prompt) + steps + 1, kv_cache_dtype)
    last = runner.feed(prompt, restart=True)[-1]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        last = runner.feed([int(last.argmax())])[-1]
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


@torch.no_grad()
def window_logits(lm: LoadedModel, ids: list[int], window: int, stride: int,
                  kv_cache_dtype: str = "auto") -> list[torch.Tensor]:
    """Each window's logits at the positions it scores ([scored, vocab] float32)."""
    runner = SequenceRunner(lm, window, kv_cache_dtype)
    return [runner.feed(ids[begin:end], restart=True)[first - 1 - begin:end - 1 - begin]
            for begin, end, first in windows(len(ids), window, stride)]


@torch.no_grad()
def evaluate(lm: LoadedModel, ids: list[int], window: int, stride: int,
             reference: list[torch.Tensor] | None = None,
             kv_cache_dtype: str = "auto") -> tuple[PerplexityResult, list[torch.Tensor]]:
    """Perplexity of ``lm`` on ``ids`` (see the module docstring), compared with a reference
    model's ``window_logits`` on the same windows; also returns ``lm``'s own."""
    logits = window_logits(lm, ids, window, stride, kv_cache_dtype)
    targets = torch.tensor([ids[p] for _, end, first in windows(len(ids), window, stride) for p in range(first, end)])
    flat = torch.cat(logits)
    nll = float(torch.nn.functional.cross_entropy(flat, targets, reduction="sum"))
    agree: float | None = None
    dlogit: float | None = None
    if reference is not None:
        ref = torch.cat(reference)
        agree = float((flat.argmax(-1) == ref.argmax(-1)).float().mean())
        dlogit = float((flat - ref).abs().mean())
    result = PerplexityResult(
        tokens_scored=len(targets),
        perplexity=float(torch.exp(torch.tensor(nll / len(targets)))),
        top1_agreement=agree,
        mean_abs_dlogit=dlogit,
        weight_mb=weight_megabytes(lm),
        decode_ms=decode_step_ms(lm, ids[:64], kv_cache_dtype=kv_cache_dtype),
    )
    return result, logits
