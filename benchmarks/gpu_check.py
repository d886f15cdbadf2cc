"""GPU check of the Triton attention backend and CUDA graphs, printed as one short table.

    python benchmarks/gpu_check.py              # on a CUDA machine (fp16)
    python benchmarks/gpu_check.py --cpu-smoke  # reduced, on the CPU via TRITON_INTERPRET=1

1. kernels: cache write, chunked prefill and split-KV decode against ReferenceBackend
   (MHA/GQA/MQA, block sizes 16/32, shuffled block tables, ragged lengths, several splits);
2. end to end: greedy generation of a tiny random Llama with Triton + CUDA graphs
   (chunked prefill, then decode with a shrinking batch padded to graph buckets) must
   give the same tokens as the reference backend run eagerly;
3. decode attention time against the memory-bandwidth bound (K/V bytes over measured
   device copy bandwidth) and against torch SDPA on dense, unpaged K/V.
Exits 1 on any mismatch.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

if "--cpu-smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from treadle.config import ModelConfig  # noqa: E402
from treadle.layers.attention import (  # noqa: E402
    AttentionBackend,
    AttentionMetadata,
    AttentionSpec,
    ReferenceBackend,
    build_attention_metadata,
)
from treadle.layers.attention.triton_backend import TritonBackend, TritonTiles  # noqa: E402
from treadle.models.llama import LlamaForCausalLM  # noqa: E402
from treadle.worker.cuda_graph import CUDAGraphRunner  # noqa: E402

KVCache = tuple[torch.Tensor, torch.Tensor]
HEADS = {"mha": (8, 8), "gqa": (8, 2), "mqa": (8, 1)}  # -> (num_heads, num_kv_heads)


class Row(NamedTuple):
    check: str
    ok: bool
    detail: str


class Batch(NamedTuple):
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, KV, D]
    v: torch.Tensor  # [T, KV, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, KV, D]
    v_cache: torch.Tensor
    meta: AttentionMetadata
    spec: AttentionSpec


def shuffled_tables(seq_lens: list[int], block_size: int, gen: torch.Generator) -> tuple[list[list[int]], int]:
    """Non-contiguous block tables for ``seq_lens``, and the number of blocks they span."""
    need = [-(-s // block_size) for s in seq_lens]
    perm = torch.randperm(sum(need) + 2, generator=gen).tolist()
    starts = [sum(need[:i]) for i in range(len(need))]
    return [perm[s : s + n] for s, n in zip(starts, need)], len(perm)


def make_batch(
    heads: tuple[int, int], head_dim: int, block_size: int, query_lens: list[int], seq_lens: list[int],
    dtype: torch.dtype, device: torch.device, seed: int = 0,
) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    (h, kv), d = heads, head_dim
    tables, num_blocks = shuffled_tables(seq_lens, block_size, gen)
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size, device)
    t = sum(query_lens)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    return Batch(rnd(t, h, d), rnd(t, kv, d), rnd(t, kv, d), rnd(num_blocks, block_size, kv, d),
                 rnd(num_blocks, block_size, kv, d), meta, AttentionSpec(h, kv, d, d**-0.5))


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max |got - want|; a NaN anywhere counts as infinitely wrong."""
    return torch.nan_to_num((got.float() - want.float()).abs(), nan=float("inf")).max().item()


def compare(b: Batch, backend: TritonBackend) -> tuple[float, bool]:
    """Max |triton - reference| (reference in fp32) and whether the written caches agree."""
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    got = backend.forward(b.q, b.k, b.v, kc, vc, b.meta, b.spec).float()
    rk, rv = b.k_cache.float(), b.v_cache.float()
    want = ReferenceBackend().forward(b.q.float(), b.k.float(), b.v.float(), rk, rv, b.meta, b.spec)
    caches_ok = torch.equal(kc.float(), rk) and torch.equal(vc.float(), rv)
    return max_err(got, want), caches_ok


def kernel_checks(device: torch.device, dtype: torch.dtype, smoke: bool) -> list[Row]:
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    d = 32 if smoke else 128
    prefill = ([19, 12, 1], [19, 33, 45]) if smoke else ([300, 77, 1], [300, 590, 1000])
    decode = ([1, 1, 1], [77, 5, 40]) if smoke else ([1] * 8, [1, 15, 16, 17, 255, 1000, 3001, 8191])
    errs: dict[str, float] = {"prefill": 0.0, "decode": 0.0}
    cache_ok, cases = True, 0
    for heads in HEADS.values():
        for bs in (16, 32):
            for kind, (ql, sl), splits in (("prefill", prefill, 4), ("decode", decode, 3), ("decode", decode, 16)):
                if smoke and (splits == 16 or bs != (16 if kind == "prefill" else 32)):
                    continue  # the smoke run only shows each path executes; tests cover the rest
                base = TritonTiles(16, 16, 16) if smoke else TritonTiles.default_for(dtype)
                tiles = dataclasses.replace(base, num_kv_splits=splits)
                b = make_batch(heads, d, bs, ql, sl, dtype, device, seed=cases)
                err, ok = compare(b, TritonBackend(tiles))
                errs[kind] = max(errs[kind], err)
                cache_ok, cases = cache_ok and ok, cases + 1
    return [
        Row("kernel: cache write", cache_ok, f"{cases} cases, caches bit-equal to reference"),
        Row("kernel: chunked prefill", errs["prefill"] < tol, f"max|err| {errs['prefill']:.1e} (tol {tol:.0e})"),
        Row("kernel: split-KV decode", errs["decode"] < tol, f"max|err| {errs['decode']:.1e} (tol {tol:.0e})"),
    ]


def quant_cache_check(device: torch.device, smoke: bool) -> Row:
    """int8 / fp8 caches (kv_quant's packed rows, a float32 scale per token and KV head): Triton
    writes the bytes the reference writes and attends over the same dequantized values (float32
    queries: IEEE products in both). The interpreter decodes fp8 on the CPU; this is the GPU's."""
    from treadle.layers.attention.kv_quant import quantize

    d = 32 if smoke else 128
    tiles = TritonTiles(16, 16, 16, 4) if smoke else None
    worst, same_bytes, cases = 0.0, True, 0
    for kv_dtype in (torch.int8, torch.float8_e4m3fn):
        for ql, sl in (([1, 1, 1], [77, 5, 40]), ([19, 12, 1], [19, 33, 45])):
            b = make_batch(HEADS["gqa"], d, 16, ql, sl, torch.float32, device, seed=cases)
            kq, vq = quantize(b.k_cache, kv_dtype), quantize(b.v_cache, kv_dtype)
            kt, vt = kq.clone(), vq.clone()
            want = ReferenceBackend().forward(b.q, b.k, b.v, kq, vq, b.meta, b.spec)
            got = TritonBackend(tiles).forward(b.q, b.k, b.v, kt, vt, b.meta, b.spec)
            same_bytes = same_bytes and torch.equal(kt.view(torch.uint8), kq.view(torch.uint8)) \
                and torch.equal(vt.view(torch.uint8), vq.view(torch.uint8))
            worst, cases = max(worst, max_err(got, want)), cases + 1
    return Row("kernel: int8 / fp8 cache", same_bytes and worst < 1e-4,
               f"{cases} cases, written bytes equal: {same_bytes}, max|err| {worst:.1e} (tol 1e-04)")


def tiny_llama(backend: AttentionBackend, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=512, hidden_size=128, intermediate_size=256,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=1024, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg, backend, dtype)
    gen = torch.Generator().manual_seed(1234)
    for p in model.parameters():  # the same random weights for every backend
        w = torch.randn(p.shape, generator=gen)
        p.data.copy_(1.0 + 0.1 * w if p.dim() == 1 else w * p.shape[-1] ** -0.5)
    return model.to(device).eval()


def greedy_generate(
    model: LlamaForCausalLM, prompts: list[list[int]], max_new: list[int], chunk: int,
    graphs: bool, device: torch.device,
) -> tuple[list[list[int]], int]:
    """Chunked prefill then decode, one mixed batch per step; returns (tokens, graph steps)."""
    cfg, bs = model.config, 16
    gen = torch.Generator().manual_seed(7)
    tables, num_blocks = shuffled_tables([len(p) + n for p, n in zip(prompts, max_new)], bs, gen)
    width = max(len(t) for t in tables)
    caches: list[KVCache] = [
        tuple(torch.randn(num_blocks, bs, cfg.num_kv_heads, cfg.head_dim, generator=gen).to(device, model.norm.weight.dtype)
              for _ in range(2)) for _ in range(cfg.num_layers)
    ]  # random: stale cache data must never be read
    runner = None
    if graphs:
        runner = CUDAGraphRunner(model, caches, len(prompts), width, bs, device, buckets=[1, 2, 4, 8])
        runner.capture()
    tokens, done = [list(p) for p in prompts], [0] * len(prompts)
    graph_steps = 0
    with torch.inference_mode():
        while True:
            live = [i for i in range(len(prompts)) if len(tokens[i]) - len(prompts[i]) < max_new[i]]
            if not live:
                return [t[len(p):] for t, p in zip(tokens, prompts)], graph_steps
            q_lens = [min(chunk, len(tokens[i]) - done[i]) for i in live]
            ids = torch.tensor([x for i, q in zip(live, q_lens) for x in tokens[i][done[i] : done[i] + q]], device=device)
            pos = torch.tensor([p for i, q in zip(live, q_lens) for p in range(done[i], done[i] + q)], device=device)
            meta = build_attention_metadata(q_lens, [done[i] + q for i, q in zip(live, q_lens)],
                                            [tables[i] for i in live], bs, device)
            if runner is not None and runner.can_run(meta):
                hidden, graph_steps = runner.run(ids, pos, meta), graph_steps + 1
            else:
                hidden = model(ids, pos, caches, meta)
            last = torch.tensor(q_lens, device=device).cumsum(0) - 1
            next_ids = model.compute_logits(hidden[last]).argmax(-1).tolist()
            for i, q, nxt in zip(live, q_lens, next_ids):
                done[i] += q
                if done[i] == len(tokens[i]):
                    tokens[i].append(nxt)


def e2e_check(device: torch.device, smoke: bool) -> Row:
    gen = torch.Generator().manual_seed(3)
    lens = [5, 17, 33] if smoke else [5, 17, 33, 130, 9, 70]
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lens]
    max_new = [4, 6, 3] if smoke else [40, 64, 23, 50, 64, 31]
    want, _ = greedy_generate(tiny_llama(ReferenceBackend(), device, torch.float32), prompts, max_new, 16, False, device)
    tiles = TritonTiles(16, 16, 16, 4) if smoke else None  # None: defaults for the dtype
    model = tiny_llama(TritonBackend(tiles), device, torch.float32)
    got, graph_steps = greedy_generate(model, prompts, max_new, 16, device.type == "cuda", device)
    same = sum(g == w for g, w in zip(got, want))
    mode = f"{graph_steps} graph-replayed decode steps" if device.type == "cuda" else "eager (no CUDA graphs on CPU)"
    return Row("e2e greedy vs reference", same == len(prompts),
               f"{same}/{len(prompts)} seqs identical, {sum(max_new)} tokens, {mode}")


def bench(fn: Callable[[], object], device: torch.device, iters: int, graph: bool = False) -> float:
    """Mean seconds per call after warm-up. ``graph``: ``iters`` calls captured in one CUDA graph
    and replayed, so the figure is the GPU's time alone, not Python's launch overhead (what the
    engine's graph-replayed decode steps see)."""
    for _ in range(min(iters, 3)):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters
    run = fn
    if graph:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(iters):
                fn()
        g.replay()
        run = g.replay
    torch.cuda.synchronize(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 5 if graph else iters
    begin.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize(device)
    return begin.elapsed_time(end) / 1e3 / (reps * iters if graph else iters)


def copy_bandwidth(device: torch.device, smoke: bool) -> float:
    """Bytes per second of a large device-to-device copy (read + write): the bound."""
    src = torch.empty((1 << 22) if smoke else (1 << 28), dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src), device, 3 if smoke else 20)
    return 2 * src.numel() * 4 / t


def decode_timing(device: torch.device, dtype: torch.dtype, batch: int, seq_len: int, bw: float, smoke: bool,
                  splits: int | None = None) -> Row:
    h, kv, d = (8, 2, 32) if smoke else (32, 8, 128)
    b = make_batch((h, kv), d, 16, [1] * batch, [seq_len] * batch, dtype, device, seed=batch)
    tiles = TritonTiles(16, 16, 16, 4) if smoke else TritonTiles.default_for(dtype)
    if splits is not None:
        tiles = dataclasses.replace(tiles, num_kv_splits=splits)
    backend = TritonBackend(tiles)
    out = backend.forward(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, b.spec)
    # the same context, dense: [batch, kv, seq_len, d]
    dense = [torch.stack([c[b.meta.block_tables[i].long()].reshape(-1, kv, d)[:seq_len] for i in range(batch)])
             .transpose(1, 2).contiguous() for c in (b.k_cache, b.v_cache)]
    qd = b.q.unsqueeze(2)  # [batch, h, 1, d]

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(qd, dense[0], dense[1], scale=b.spec.scale, enable_gqa=True)

    err = max_err(out, sdpa().squeeze(2))
    iters = 1 if smoke else 50
    graph = device.type == "cuda"
    t_tri = bench(lambda: backend.forward(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, b.spec), device, iters, graph)
    t_sdpa = bench(sdpa, device, iters, graph)
    kv_bytes = 2 * batch * seq_len * kv * d * b.q.element_size()
    t_bound = kv_bytes / bw
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    return Row(
        f"decode B={batch} ctx={seq_len} splits={tiles.num_kv_splits}", err < tol,
        f"triton {t_tri * 1e6:.0f}us = {t_bound / t_tri:.0%} of bw bound {t_bound * 1e6:.0f}us; "
        f"sdpa(dense) {t_sdpa * 1e6:.0f}us ({t_sdpa / t_tri:.2f}x); max|err| {err:.0e}",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="reduced run on the CPU (Triton interpreter)")
    parser.add_argument("--splits", type=int, nargs="*", default=[],
                        help="also time decode at these num_kv_splits (a sweep; timings only)")
    args = parser.parse_args()
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-smoke for the reduced CPU check", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    dtype = torch.float32 if args.cpu_smoke else torch.float16
    start = time.perf_counter()
    rows = kernel_checks(device, dtype, args.cpu_smoke)
    rows.append(quant_cache_check(device, args.cpu_smoke))
    rows.append(e2e_check(device, args.cpu_smoke))
    bw = copy_bandwidth(device, args.cpu_smoke)
    shapes = [(2, 50)] if args.cpu_smoke else [(1, 8192), (16, 2048), (64, 4096)]
    rows += [decode_timing(device, dtype, n, s, bw, args.cpu_smoke) for n, s in shapes]
    sweep = [(2, 50)] if args.cpu_smoke else [(1, 1024), (1, 8192), (4, 4096), (16, 2048), (64, 512), (64, 4096)]
    rows += [decode_timing(device, dtype, n, s, bw, args.cpu_smoke, k) for k in args.splits for n, s in sweep]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (TRITON_INTERPRET=1)"
    print(f"treadle gpu_check on {name}, {dtype}, copy bandwidth {bw / 1e9:.0f} GB/s")
    width = max(len(r.check) for r in rows)
    for r in rows:
        print(f"{r.check:<{width}}  {'ok  ' if r.ok else 'FAIL'}  {r.detail}")
    print(f"{sum(r.ok for r in rows)}/{len(rows)} checks ok in {time.perf_counter() - start:.0f}s")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
