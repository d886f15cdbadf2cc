"""Decode step time with the KV cache in the model's dtype vs int8 / fp8, side by side.

Each engine (one per ``--kv-cache-dtype``) gets the same batch of requests with long prompts;
after their prefills, decode steps (one new token per request) are timed, the engines taking
turns block by block so they share the machine's noise. Reports the median step per engine and
the ratio to the first. The KV cache memory each holds is printed too (same token capacity in
less memory: the quantized caches are smaller).

    .venv/bin/python benchmarks/kv_cache_dtype_cpu.py --model smollm2-135m-instruct --batch 16 \
        --prompt-len 1000 --steps 24 [--kv auto int8 fp8] [--threads N] [--no-fused-layers]

``--kernel``: no engine, no prefill: the C decode kernel alone (write + attention of one layer)
at SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim 64, block 16) over random float32,
int8 and fp8 caches, several caches per pass (>= 96 MB, more than the L3) as a step's 30 layers
are; "x30" is a whole step's attention.

    .venv/bin/python benchmarks/kv_cache_dtype_cpu.py --kernel --batch 16 --prompt-len 1000
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from treadle import LLM, SamplingParams


def start(model: str, kv: str, batch: int, prompt_len: int, steps: int, fused: bool) -> LLM:
    blocks = batch * (-(-(prompt_len + steps + 16) // 16))
    llm = LLM(model, kv_cache_dtype=kv, num_kv_blocks=blocks, block_size=16, max_num_seqs=batch,
              max_num_batched_tokens=2048, fused_layers=fused, enable_prefix_caching=False)
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps * 2 + 8, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        prompt = torch.randint(10, 400, (prompt_len,), generator=g).tolist()
        eng.add_request(str(i), {"prompt_token_ids": prompt}, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
        eng.step()  # prefill
    return llm


def kernel_times(batch: int, context: int, repeats: int = 7) -> dict[str, float]:
    """Median ms per layer of the C decode kernel per cache dtype, interleaved."""
    from treadle.kernels.attention import paged_decode
    from treadle.layers.attention import build_attention_metadata
    from treadle.layers.attention.cpu import build_plan
    from treadle.layers.attention.kv_quant import quantize

    h, hkv, d, bs = 9, 3, 64, 16
    g = torch.Generator().manual_seed(0)
    need = -(-context // bs)
    perm = torch.randperm(batch * need + 4, generator=g).tolist()
    tables = [perm[i * need : (i + 1) * need] for i in range(batch)]
    shape = (len(perm), bs, hkv, d)
    copies = max(1, min(16, -(-(96 << 20) // (2 * 4 * torch.Size(shape).numel()))))
    floats = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(copies)]
    caches = {"float32": floats}
    for name, dtype in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
        caches[name] = [(quantize(k, dtype), quantize(v, dtype)) for k, v in floats]
    qkv = torch.randn(batch, (h + 2 * hkv) * d, generator=g)
    q, k, v = (x.view(batch, -1, d) for x in qkv.split([h * d, hkv * d, hkv * d], dim=-1))
    plan = build_plan(build_attention_metadata([1] * batch, [context] * batch, tables, bs))
    assert plan.decode is not None and plan.decode.kernel_args is not None
    args = plan.decode.kernel_args
    times: dict[str, list[float]] = {name: [] for name in caches}
    for _ in range(repeats):
        for name, pairs in caches.items():
            t = time.perf_counter()
            for kc, vc in pairs:
                assert paged_decode(q, k, v, kc, vc, *args, d**-0.5) is not None
            times[name].append((time.perf_counter() - t) / len(pairs) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--kv", nargs="+", default=["auto", "int8", "fp8"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-fused-layers", action="store_true")
    ap.add_argument("--kernel", action="store_true", help="the C decode kernel alone, SmolLM2-135M's shapes")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.kernel:
        res = kernel_times(args.batch, args.prompt_len)
        print(f"C decode kernel, batch {args.batch} x context {args.prompt_len}, SmolLM2 shapes, "
              f"threads {torch.get_num_threads()}")
        print(f"{'cache':>8} {'ms/layer':>9} {'x30 ms':>8} {'ratio':>6}")
        for name, ms in res.items():
            print(f"{name:>8} {ms:9.2f} {ms * 30:8.1f} {ms / res['float32']:6.2f}")
        return
    engines = {}
    for kv in args.kv:
        t = time.perf_counter()
        engines[kv] = start(args.model, kv, args.batch, args.prompt_len, args.steps, not args.no_fused_layers)
        print(f"kv {kv}: started and prefilled in {time.perf_counter() - t:.0f} s", flush=True)
    times: dict[str, list[float]] = {kv: [] for kv in args.kv}
    for _ in range(args.steps // 4):  # blocks of 4 steps per engine, in turn
        for kv, llm in engines.items():
            for _ in range(4):
                t = time.perf_counter()
                llm.engine.step()
                times[kv].append(time.perf_counter() - t)
    base = statistics.median(times[args.kv[0]])
    print(f"model {args.model}, batch {args.batch}, context ~{args.prompt_len}, threads {torch.get_num_threads()}, "
          f"fused layers {not args.no_fused_layers}")
    print(f"{'kv_cache_dtype':>14} {'KV MiB':>8} {'step ms (median)':>17} {'ratio':>6}")
    for kv, llm in engines.items():
        cfg = llm.engine.config.cache
        mib = cfg.num_blocks * cfg.bytes_per_block / (1 << 20)
        med = statistics.median(times[kv])
        print(f"{cfg.kv_cache_dtype:>14} {mib:8.1f} {med * 1e3:17.1f} {med / base:6.2f}")


if __name__ == "__main__":
    main()
