"""MoE decode step vs a dense model of the same active parameters, side by side in one process:
engines' decode steps interleaved so every model sees the same machine load.

    .venv/bin/python benchmarks/make_random_moe.py          # once: the two random models
    .venv/bin/python benchmarks/moe_decode_cpu.py --batch 1 16 --threads 1
    .venv/bin/python benchmarks/moe_decode_cpu.py --batch 1 16 --threads 1 --quantization int8   # Q8_0 blocks

Models (benchmarks/make_random_moe.py): a Mixtral-shaped MoE (8 experts of 1024, top-2) and a
dense Llama with intermediate 2048, same attention, embedding and lm_head. "dense" runs the same
torch path as the MoE (--no-fused-layers); "dense fused" is the default (the fused C decoder
layer, which the MoE block does not have). Each engine prefills ``--batch`` prompts of
``--prompt-len`` tokens, then all take ``--steps`` decode steps in turn; medians and the MoE's
ratio to each dense one. Also printed: the distinct experts a batch's tokens touch per sparse
layer (the weights a step reads grow with it, up to all 8 experts).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from treadle import LLM, SamplingParams

ROOT = "/tmp/treadle-bench"
MODELS = {"moe": (f"{ROOT}/random-moe-8x1024-top2", True), "dense": (f"{ROOT}/random-dense-2048", False),
          "dense fused": (f"{ROOT}/random-dense-2048", True)}


def engine(path: str, fused: bool, batch: int, prompt_len: int, steps: int, quantization: str):  # noqa: ANN201
    llm = LLM(path, kv_cache_memory="256MiB", fused_layers=fused, enable_prefix_caching=False,
              quantization=quantization)
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        eng.add_request(str(i), {"prompt_token_ids": [100 + (7 * i + j) % 1000 for j in range(prompt_len)]}, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
        eng.step()  # prefill
    return llm, eng


def experts_touched(eng) -> list[int]:  # noqa: ANN001
    """Distinct experts per sparse layer in the next step (a forward hook on each FusedMoE)."""
    seen: list[int] = []
    model = eng.model_runner().model
    hooks = [layer.mlp.experts.register_forward_hook(lambda m, a, o: seen.append(int(a[1].ids.unique().numel())))
             for layer in model.layers if hasattr(layer.mlp, "experts")]
    eng.step()
    for h in hooks:
        h.remove()
    return seen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quantization", default="none", help="none (float32) or int8 / int4 (experts too)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"prompt {args.prompt_len}, {args.steps} steps, {args.threads} threads, quantization {args.quantization}, "
          "median decode step (wall ms)")
    print("| batch | moe | dense | dense fused | moe / dense | moe / dense fused | experts touched per layer |")
    print("|---|---|---|---|---|---|---|")
    for batch in args.batch:
        engs = {name: engine(path, fused, batch, args.prompt_len, args.steps + 1, args.quantization)
                for name, (path, fused) in MODELS.items()}
        touched = experts_touched(engs["moe"][1])
        samples: dict[str, list[float]] = {name: [] for name in engs}
        for _ in range(args.steps):
            for name, (_, eng) in engs.items():
                t0 = time.perf_counter()
                eng.step()
                samples[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(s) * 1e3 for name, s in samples.items()}
        print(f"| {batch} | {med['moe']:.2f} | {med['dense']:.2f} | {med['dense fused']:.2f} | "
              f"{med['moe'] / med['dense']:.2f}x | {med['moe'] / med['dense fused']:.2f}x | "
              f"{statistics.mean(touched):.1f} of 8 |", flush=True)
        for llm, _ in engs.values():
            llm.shutdown()
        del engs


if __name__ == "__main__":
    main()
