"""SmolLM2-135M-Instruct (Q4_1 GGUF): each quantization mode against the dequantized
float32 model, side by side in one process -- logit error and perplexity on a fixed
text, resident linear-weight memory, and batch-1 decode step time.

Run: .venv/bin/python benchmarks/quantized_smollm2_cpu.py [threads] [modes...]
(modes default: gguf int8 int4-g32 int4-g128; MODE:bfloat16 loads in bfloat16; timings are medians, the machine may be shared)
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from treadle.layers.attention import build_attention_metadata
from treadle.layers.attention.cpu import CPUBackend
from treadle.layers.linear import Linear
from treadle.loaders import LoadedModel, load_model
from treadle.worker.fused_layers import fuse_decoder_layers

MODEL = "smollm2-135m-instruct"
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from wine making. "
    "Books became cheaper, literacy spread, and ideas moved faster across Europe than ever before."
)
BLOCK = 16


def model_megabytes(lm: LoadedModel) -> float:
    """Resident weights: every parameter (embedding and norms included) plus the linear
    layers' scale/zero buffers; the rotary cos/sin tables are not counted."""
    params = sum(t.numel() * t.element_size() for t in lm.model.parameters())
    buffers = [t for m in lm.model.modules() if isinstance(m, Linear) for t in m.buffers()]
    return (params + sum(t.numel() * t.element_size() for t in buffers)) / 1e6


def linear_megabytes(lm: LoadedModel) -> float:
    tensors = [t for m in lm.model.modules() if isinstance(m, Linear) for t in [*m.parameters(), *m.buffers()]]
    return sum(t.numel() * t.element_size() for t in tensors) / 1e6


def fresh_cache(lm: LoadedModel, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cfg = lm.config
    shape = (-(-tokens // BLOCK) + 1, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    dtype = lm.model.dtype
    return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(cfg.num_layers)]


@torch.no_grad()
def prompt_logits(lm: LoadedModel, ids: list[int]) -> torch.Tensor:  # [n, vocab]
    caches = fresh_cache(lm, len(ids))
    meta = build_attention_metadata([len(ids)], [len(ids)], [list(range(len(caches[0][0])))], BLOCK)
    meta.plan = lm.model.backend.plan(meta)
    hidden = lm.model(torch.tensor(ids), torch.arange(len(ids)), caches, meta)
    return lm.model.compute_logits(hidden)


@torch.no_grad()
def decode_step_ms(lm: LoadedModel, context: int = 64, steps: int = 24) -> float:
    """Median time of one batch-1 decode step (model forward + logits) after `context` tokens."""
    caches = fresh_cache(lm, context + steps + 1)
    table = [list(range(len(caches[0][0])))]
    meta = build_attention_metadata([context], [context], table, BLOCK)
    meta.plan = lm.model.backend.plan(meta)
    lm.model(torch.arange(context) + 100, torch.arange(context), caches, meta)
    times, token = [], 100
    for pos in range(context, context + steps):
        meta = build_attention_metadata([1], [pos + 1], table, BLOCK)
        t = time.perf_counter()
        meta.plan = lm.model.backend.plan(meta)  # once per step, as the runner does
        logits = lm.model.compute_logits(lm.model(torch.tensor([token]), torch.tensor([pos]), caches, meta))
        times.append(time.perf_counter() - t)
        token = int(logits.argmax())
    return statistics.median(times) * 1e3


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    return float(nll.exp())


def main() -> None:
    args = sys.argv[1:]
    if args and args[0].isdigit():
        torch.set_num_threads(int(args.pop(0)))
    modes = args or ["gguf", "int8", "int4-g32", "int4-g128"]
    ref = load_model(MODEL, CPUBackend(), quantization=None)
    ids = ref.tokenizer.encode(TEXT)
    ref_logits = prompt_logits(ref, ids)
    print(f"threads={torch.get_num_threads()} tokens={len(ids)}")
    print(f"{'mode':14s} {'weights MB':>10s} {'linear MB':>9s} {'max|dlogit|':>11s} {'mean|dlogit|':>12s} {'top1 agree':>10s} {'ppl':>7s}")
    print(f"{'float32':14s} {model_megabytes(ref):10.1f} {linear_megabytes(ref):9.1f} {0:11.3f} {0:12.4f} {100:9.1f}% {perplexity(ref_logits, ids):7.3f}")
    models = {"float32": ref}
    for mode in modes:
        quant, _, dtype = mode.partition(":")  # e.g. "gguf:bfloat16" runs the whole model in bfloat16
        lm = models[mode] = load_model(MODEL, CPUBackend(), dtype=dtype or "float32", quantization=quant)
        fuse_decoder_layers(lm.model)  # as the engine's runner does (GGUF-block layers only)
        logits = prompt_logits(lm, ids).float()
        err = (logits - ref_logits).abs()
        agree = float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()) * 100
        print(
            f"{mode:14s} {model_megabytes(lm):10.1f} {linear_megabytes(lm):9.1f} {float(err.max()):11.3f} {float(err.mean()):12.4f}"
            f" {agree:9.1f}% {perplexity(logits, ids):7.3f}"
        )
    print("batch-1 decode step (ms, median of rounds; interleaved):")
    rounds: dict[str, list[float]] = {m: [] for m in models}
    for _ in range(3):
        for mode, lm in models.items():
            rounds[mode].append(decode_step_ms(lm))
    base = statistics.median(rounds["float32"])
    for mode, ts in rounds.items():
        ms = statistics.median(ts)
        print(f"{mode:14s} {ms:8.2f} ms  {1000 / ms:7.1f} tok/s  {base / ms:5.2f}x vs float32")


if __name__ == "__main__":
    main()
