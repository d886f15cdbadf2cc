"""Float checkpoints in bfloat16 on the CPU (#16 item 5): decode steps and a prompt of SmolLM2-135M
(the GGUF dequantized, ``--quantization none``), in one process, interleaved step by step:

- float32: torch's float32 matmuls, the module path (a float32 model's layers are not fused);
- bfloat16, fused C layer: bfloat16 weights, float32 activations, each decoder layer one C call on
  decode steps (``fuse_decoder_layers``, as the engine's runner does) -- what ``--dtype bfloat16`` runs;
- bfloat16, modules: the same model on the module path (``fused_layers=False``): per-linear C
  matmuls, fused float32 ops, Python between them;
- bfloat16, torch matmul: bfloat16 weights and activations on torch's ops (the path before #16 item 5).

The bfloat16 models keep a bfloat16 KV cache (the engine's ``kv_cache_dtype`` auto). Batch sizes
share one 256-token context per sequence; the bfloat16 models past the first get a copy of its
prompt's cache (same tables), so only the first pays a batched prompt. CPU time of the process
(= thread time at one thread; the machine may be shared), median over steps.

Run: .venv/bin/python benchmarks/bf16_decode_cpu.py [--steps 16] [--prompt-len 256] [--batch 1 8]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from paged_session import PagedSession  # noqa: E402

from treadle.layers.attention.cpu import CPUBackend  # noqa: E402
from treadle.loaders import LoadedModel, load_model, open_model_source, quantization_plan  # noqa: E402
from treadle.models.registry import model_class  # noqa: E402
from treadle.worker.fused_layers import fuse_decoder_layers  # noqa: E402

FUSED = "bfloat16, fused C layer"


def torch_bfloat16(name: str) -> LoadedModel:
    """bfloat16 weights and activations on plain torch ops (no method factory, no C matmul)."""
    src = open_model_source(name)
    _, weights = quantization_plan(src, "none")
    model = model_class(src.config.architecture)(src.config, CPUBackend(), torch.bfloat16)
    model.load_weights(weights())
    model.process_weights_after_loading()
    return LoadedModel(model.eval(), src.config, src.tokenizer, src.path)


def load_all(name: str) -> dict[str, tuple[LoadedModel, torch.dtype]]:
    """name -> (model, KV cache dtype)."""
    fused = load_model(name, CPUBackend(), dtype="bfloat16", quantization="none")
    assert fuse_decoder_layers(fused.model) == fused.config.num_layers
    bf16 = torch.bfloat16
    return {
        "float32": (load_model(name, CPUBackend(), dtype="float32", quantization="none"), torch.float32),
        FUSED: (fused, bf16),
        "bfloat16, modules": (load_model(name, CPUBackend(), dtype="bfloat16", quantization="none"), bf16),
        "bfloat16, torch matmul": (torch_bfloat16(name), bf16),
    }


def sessions_for(models: dict[str, tuple[LoadedModel, torch.dtype]], batch: int, prompt_len: int,
                 steps: int) -> tuple[dict[str, PagedSession], dict[str, float]]:
    """One session per model, each sequence holding a prompt; the prompts' CPU time when fed."""
    prompts = [[(7 * i + 3 + b) % 1000 + 10 for i in range(prompt_len)] for b in range(batch)]
    sessions, prompt_times = {}, {}
    for name, (lm, cache) in models.items():
        s = sessions[name] = PagedSession(lm, batch, prompt_len + steps + 1, block_size=16, cache_dtype=cache)
        if batch > 1 and cache is torch.bfloat16 and name != FUSED:  # the fused model's prompt cache
            s.caches, s.lens = [(k.clone(), v.clone()) for k, v in sessions[FUSED].caches], list(sessions[FUSED].lens)
            continue
        t = time.process_time()
        s.feed(prompts)
        prompt_times[name] = time.process_time() - t
    return sessions, prompt_times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    models = load_all(args.model)
    for batch in args.batch:
        sessions, prompt_times = sessions_for(models, batch, args.prompt_len, args.steps)
        for name, t in prompt_times.items():
            print(f"batch {batch:2d} {name:24s} prompt {batch} x {args.prompt_len} tokens: {t * 1e3:9.1f} ms")
        times: dict[str, list[float]] = {name: [] for name in sessions}
        for _ in range(args.steps):
            for name, session in sessions.items():
                t = time.process_time()
                session.feed([[42]] * batch)
                times[name].append(time.process_time() - t)
        base = statistics.median(times["float32"])
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"batch {batch:2d} {name:24s} decode step {med * 1e3:7.2f} ms  ({base / med:.2f}x float32)"
                  f"  min {min(ts) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
