"""Float checkpoints in bfloat16 on the CPU (#16 item 5): one decode step of SmolLM2-135M
(the GGUF dequantized, ``--quantization none``) in float32, in bfloat16 on the C kernel
(``BFloat16CPUMethod``, the default now), and in bfloat16 on torch's matmul (each linear layer's
method set back to the plain one: main's path), in one process, interleaved step by step.

Thread CPU time with one thread (the machine may be shared); the model's forward and logits
for one new token after a 256-token prompt, median over steps. Also prints the prompt (prefill)
time of each, once.

Run: .venv/bin/python benchmarks/bf16_decode_cpu.py [--steps 24] [--prompt-len 256]
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
from treadle.layers.linear import Linear, UnquantizedLinearMethod  # noqa: E402
from treadle.loaders import LoadedModel, load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(1)
    models: dict[str, LoadedModel] = {
        "float32": load_model(args.model, CPUBackend(), dtype="float32", quantization="none"),
        "bfloat16 C kernel": load_model(args.model, CPUBackend(), dtype="bfloat16", quantization="none"),
        "bfloat16 torch matmul": load_model(args.model, CPUBackend(), dtype="bfloat16", quantization="none"),
    }
    for m in models["bfloat16 torch matmul"].model.modules():
        if isinstance(m, Linear):
            m.method = UnquantizedLinearMethod()
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(args.prompt_len)]
    sessions, times, token = {}, {name: [] for name in models}, 42
    for name, lm in models.items():
        sessions[name] = PagedSession(lm, 1, args.prompt_len + args.steps + 1, block_size=16)
        t = time.thread_time()
        sessions[name].feed([prompt])
        print(f"{name:22s} prompt {args.prompt_len} tokens: {(time.thread_time() - t) * 1e3:8.1f} ms")
    for _ in range(args.steps):
        for name, session in sessions.items():
            t = time.thread_time()
            session.feed([[token]])
            times[name].append(time.thread_time() - t)
    base = statistics.median(times["float32"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:22s} decode step {med * 1e3:7.2f} ms  ({base / med:.2f}x float32)  min {min(ts) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
