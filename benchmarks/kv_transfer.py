"""Loopback KV handover: bandwidth (MB/s) and time per request (ms) of the tcp and shm connectors.

A producer process holds the KV of ``--requests`` prompts of ``--tokens`` tokens each in a KV
cache shaped like ``--shape`` (layers, KV heads, head dim, dtype); this process is a consumer
that pulls them one by one through the real connector (``start_step`` with a LoadSpec, then
``get_finished`` until it reports the load), so each figure covers the whole handover: pull
request, the producer's copy out of its blocks, checksums, frames (tcp) or the segment (shm),
the checks and the copy into the consumer's blocks. Connectors alternate per round; medians.
``--tp P C``: the producer runs P tensor-parallel ranks (connectors over their KV heads, on
ports port..port+P-1) and this process C consumer ranks; a handover ends when every consumer
rank has its heads.

    python benchmarks/kv_transfer.py --tokens 512 2048 --requests 8 --rounds 3
    python benchmarks/kv_transfer.py --shape llama3-8b-bf16 --tokens 512 --tp 2 1

With ``--model``, the handover of real requests instead: a producer engine (its own process, one
thread) computes each prompt (max_tokens 1, do_remote_decode); two consumer engines in this
process (one thread), layer-wise start on and off, take turns receiving a request with the
producer's kv_transfer_params. The figure is the time from the consumer's ``add_request`` to its
first output token (pull + the last prompt token's step), medians per prompt length.

    python benchmarks/kv_transfer.py --model smollm2-135m-instruct --tokens 256 1024 --requests 4
"""
from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from dataclasses import replace
from typing import Any

import torch

from treadle.config import KVTransferConfig
from treadle.core.kv_connector_data import KVConnectorMetadata, LoadSpec
from treadle.kv_transfer import create_connector
from treadle.kv_transfer.heads import RankPlacement

SHAPES = {  # layers, KV heads, head dim, dtype
    "smollm2-135m": (30, 3, 64, torch.float32),
    "llama3-8b-bf16": (32, 8, 128, torch.bfloat16),
}
BLOCK = 16


def kv_cache(shape: tuple[int, int, int, torch.dtype], num_blocks: int, fill: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers, heads, dim, dtype = shape
    make = (lambda: torch.randn(num_blocks, BLOCK, heads, dim).to(dtype)) if fill else \
        (lambda: torch.zeros(num_blocks, BLOCK, heads, dim, dtype=dtype))
    return [(make(), make()) for _ in range(layers)]


def rank_connectors(cfg: KVTransferConfig, shape: Any, num_blocks: int, fill: bool, tp: int) -> list[Any]:
    """One connector per tensor-parallel rank, each over a cache of its share of the KV heads."""
    layers, heads, dim, dtype = shape
    return [create_connector(cfg, kv_cache((layers, max(1, heads // tp), dim, dtype), num_blocks, fill),
                             RankPlacement(heads, tp, r)) for r in range(tp)]


def producer(cfg: KVTransferConfig, shape: Any, blocks_per_req: int, num_reqs: int, tp: int, conn: Any) -> None:
    torch.set_num_threads(1)
    connectors = rank_connectors(cfg, shape, blocks_per_req * num_reqs, True, tp)
    saves = {f"r{i}": list(range(i * blocks_per_req, (i + 1) * blocks_per_req)) for i in range(num_reqs)}
    for c in connectors:
        c.start_step(KVConnectorMetadata(saves=saves))
    conn.send("ready")
    conn.recv()  # stop
    for c in connectors:
        c.shutdown()


def pull_all(cfg: KVTransferConfig, shape: Any, tokens: int, num_reqs: int, tp: tuple[int, int]) -> list[float]:
    blocks = -(-tokens // BLOCK)
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=producer, args=(cfg, shape, blocks, num_reqs, tp[0], child), daemon=True)
    proc.start()
    consumers = rank_connectors(replace(cfg, role="kv_consumer"), shape, blocks, False, tp[1])
    try:
        assert parent.poll(120), "the producer did not start"
        parent.recv()
        times = []
        for i in range(num_reqs):
            start = time.perf_counter()
            load = LoadSpec(f"c{i}", f"r{i}", cfg.ip, cfg.port, tokens, list(range(blocks)), tp[0])
            for consumer in consumers:
                consumer.start_step(KVConnectorMetadata(loads=[load]))
            for consumer in consumers:
                out = None
                while out is None:
                    out = consumer.get_finished(0.001)
                assert out.finished_loading == [f"c{i}"], out.failed_loading
            times.append(time.perf_counter() - start)
        return times
    finally:
        for consumer in consumers:
            consumer.shutdown()
        parent.send("stop")
        proc.join(10)


ENGINE_KW: dict[str, Any] = dict(max_model_len=2048, num_kv_blocks=512, block_size=16, max_num_batched_tokens=2048)


def producer_engine(model: str, port: int, conn: Any) -> None:
    """Compute each prompt sent down ``conn`` and answer its kv_transfer_params; meanwhile
    keep stepping while blocks are held (as an engine-core process does), so pulls are served."""
    from treadle.engine.llm_engine import LLMEngine
    from treadle.sampling_params import SamplingParams

    torch.set_num_threads(1)
    kv = {"kv_connector": "tcp", "kv_role": "kv_producer", "kv_port": port, "producer_block_timeout_s": 600}
    engine = LLMEngine.from_args(model, kv_transfer_config=kv, **ENGINE_KW)
    conn.send("ready")
    n = 0
    while True:
        if conn.poll(0.002):
            ids = conn.recv()
            if ids is None:
                break
            n += 1
            params = SamplingParams(max_tokens=1, temperature=0, kv_transfer_params={"do_remote_decode": True})
            engine.add_request(f"p{n}", {"prompt_token_ids": ids}, params)
            final = None
            while final is None:
                final = next((o for o in engine.step() if o.finished), None)
            conn.send(final.kv_transfer_params)
        elif engine.scheduler.has_pending_transfers():
            engine.step()
    engine.shutdown()


def first_token_s(engine: Any, rid: str, ids: list[int], params: dict[str, Any]) -> float:
    """Seconds from add_request to the first output token; then the request is run out."""
    from treadle.sampling_params import SamplingParams

    start = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0,
                                                                      kv_transfer_params=params))
    took = None
    while took is None:
        if any(o.outputs[0].token_ids for o in engine.step()):
            took = time.perf_counter() - start
    deadline = time.monotonic() + 30
    while (engine.has_unfinished_requests() or engine.scheduler.has_pending_transfers()) and \
            time.monotonic() < deadline:
        engine.step()
    assert engine.scheduler.stats()["num_recomputes"] == 0, "a transfer failed: the figure would be a recompute"
    return took


def handover(model: str, token_counts: list[int], reps: int) -> None:
    from treadle.engine.llm_engine import LLMEngine

    torch.set_num_threads(1)
    port = 47900
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=producer_engine, args=(model, port, child), daemon=True)
    proc.start()
    consumers = {on: LLMEngine.from_args(model, kv_transfer_config={"kv_connector": "tcp", "kv_role": "kv_consumer",
                                                                     "layerwise_start": on}, **ENGINE_KW)
                 for on in (True, False)}
    gen = torch.Generator().manual_seed(0)
    vocab = consumers[True].config.model.vocab_size
    try:
        assert parent.poll(600), "the producer did not start"
        parent.recv()
        print(f"model {model}; {reps} requests per row and mode; medians")
        print("| tokens | layer-wise off: handover p50 (ms) | layer-wise on: handover p50 (ms) | on / off |")
        print("|---:|---:|---:|---:|")
        for tokens in token_counts:
            times: dict[bool, list[float]] = {True: [], False: []}
            for r in range(reps):
                for on in ((True, False) if r % 2 else (False, True)):  # alternate which goes first
                    ids = torch.randint(3, vocab, (tokens,), generator=gen).tolist()
                    parent.send(ids)
                    assert parent.poll(300), "the producer did not answer (see its traceback above)"
                    times[on].append(first_token_s(consumers[on], f"{tokens}-{r}-{on}", ids, parent.recv()))
            off, on_ = statistics.median(times[False]), statistics.median(times[True])
            print(f"| {tokens} | {off * 1e3:.1f} | {on_ * 1e3:.1f} | {on_ / off:.2f} |")
    finally:
        parent.send(None)
        proc.join(30)
        for engine in consumers.values():
            engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=SHAPES, default="smollm2-135m")
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tp", type=int, nargs=2, default=[1, 1], metavar=("PRODUCER", "CONSUMER"),
                    help="tensor-parallel sizes of the producer and the consumer")
    ap.add_argument("--model", default=None, help="handover of real requests, layer-wise start on vs off")
    args = ap.parse_args()
    if args.model:
        handover(args.model, args.tokens, args.requests)
        return
    shape = SHAPES[args.shape]
    layers, heads, dim, dtype = shape
    bytes_per_token = 2 * layers * heads * dim * torch.empty(0, dtype=dtype).element_size()
    print(f"shape {args.shape}: {bytes_per_token / 1024:.1f} KiB of KV per token; {args.requests} requests per round; "
          f"TP {args.tp[0]} -> {args.tp[1]}")
    print("| connector | tokens | KV per request (MB) | handover p50 (ms) | bandwidth p50 (MB/s) |")
    print("|---|---:|---:|---:|---:|")
    port = 47000
    for tokens in args.tokens:
        results: dict[str, list[float]] = {"tcp": [], "shm": []}
        for _ in range(args.rounds):
            for name in results:
                port += args.tp[0]
                cfg = KVTransferConfig(name, "kv_producer", "127.0.0.1", port, "bench", 30.0, 600.0, False)
                results[name] += pull_all(cfg, shape, tokens, args.requests, tuple(args.tp))  # type: ignore[arg-type]
        mb = -(-tokens // BLOCK) * BLOCK * bytes_per_token / 1e6
        for name, times in results.items():
            p50 = statistics.median(times)
            print(f"| {name} | {tokens} | {mb:.2f} | {p50 * 1e3:.2f} | {mb / p50:.0f} |")


if __name__ == "__main__":
    main()
