"""`treadle bench comm`: how much tensor-parallel communication is hidden behind computation,
overlap (``--comm-overlap``) off vs on.

Starts T worker ranks (torch.multiprocessing spawn, a gloo group on 127.0.0.1 -- NCCL with
``--device cuda`` on a machine with T GPUs), each loading its shard of the model, and times one
model step of ``--tokens`` tokens (a prompt chunk: 16+ tokens is the goal's case), alternating
rounds so that machine noise hits every variant alike. Per mode (overlap off / on):

    with comm   the step as it runs
    compute     the same step with every collective skipped (outputs discarded)
    comm alone  the same all-reduces (count and sizes) with nothing else running

    hidden % = (compute + comm alone - with comm) / comm alone

    treadle bench comm --model stories260k --tokens 64 -tp 2
    python benchmarks/make_random_llama.py && \
    treadle bench comm --model /tmp/treadle-bench/random-llama-150m --tokens 16,64 -tp 2
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from treadle.core.step_data import NewRequestData, ScheduledRequest, SchedulerOutput
from treadle.distributed import ParallelContext, shard_config
from treadle.layers.attention.selector import select_backend
from treadle.loaders import load_model
from treadle.sampling_params import SamplingParams
from treadle.worker.model_runner import ModelRunner, allocate_kv_cache

BLOCK = 16


def step_for(tokens: int, hidden_vocab: int) -> SchedulerOutput:
    """One request's first chunk of ``tokens`` prompt tokens (blocks 0..)."""
    prompt = [1 + (7 * j) % (hidden_vocab - 2) for j in range(tokens + 1)]
    new = NewRequestData("r", prompt, SamplingParams(temperature=0.0, max_tokens=1), (1,))
    blocks = list(range(-(-len(prompt) // BLOCK)))
    return SchedulerOutput([new], [ScheduledRequest("r", blocks, 0, tokens)], [])


def time_steps(runner: ModelRunner, sched: SchedulerOutput, repeats: int) -> float:
    batch = runner._prepare(sched)  # noqa: SLF001 - the benchmark times the model step alone
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(repeats):
        runner.forward(batch)
    return (time.perf_counter() - t0) / repeats


def time_comm(ctx: ParallelContext, shapes: list[tuple[int, int]], layers: int, repeats: int) -> float:
    bufs = [torch.randn(s, device=ctx.device) for s in shapes]
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(repeats):
        for b in bufs:  # the embedding's reduce, then two per layer (attention, MLP)
            ctx.all_reduce(b)
        for _ in range(2 * layers):
            handles = [ctx.all_reduce_async(b) for b in bufs]
            for h in handles:
                h.wait()
    return (time.perf_counter() - t0) / repeats


def rank_main(rank: int, args: argparse.Namespace, addr: str, out: dict) -> None:
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # unreduced partial sums (collectives skipped) must not hit slow denormals
    backend = "nccl" if args.device == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=addr, rank=rank, world_size=args.tp, timeout=timedelta(seconds=300))
    device = torch.device(args.device)
    loaded = None
    try:
        from treadle.loaders import open_model_source
        source = open_model_source(args.model)
        ctx = ParallelContext.create(args.tp, 1, rank, source.config.vocab_size, 300, device)
        loaded = load_model(source, select_backend("auto", device), "float32", device, "none", ctx)
        local = shard_config(source.config, args.tp, rank)
        results = {}
        for tokens in args.tokens:
            kv = allocate_kv_cache(local, -(-(tokens + 1) // BLOCK) + 1, BLOCK, torch.float32, device)
            runners = {mode: ModelRunner(loaded.model, kv, BLOCK, tokens, device, 0, None, False, ctx,
                                         overlap=mode == "on") for mode in ("off", "on")}
            sched = step_for(tokens, source.config.vocab_size)
            for r in runners.values():
                r._update_states(sched)  # noqa: SLF001
            hidden = source.config.hidden_size
            comm_shapes = {"off": [(tokens, hidden)], "on": [(tokens // 2, hidden), (tokens - tokens // 2, hidden)]}
            samples: dict[str, list[float]] = {}
            for _ in range(args.rounds):
                for mode, runner in runners.items():
                    ctx.skip_collectives = False
                    samples.setdefault(f"{mode} with comm", []).append(time_steps(runner, sched, args.repeats))
                    ctx.skip_collectives = True
                    samples.setdefault(f"{mode} compute", []).append(time_steps(runner, sched, args.repeats))
                    ctx.skip_collectives = False
                    samples.setdefault(f"{mode} comm alone", []).append(
                        time_comm(ctx, comm_shapes[mode], len(loaded.model.stage), args.repeats))
            results[tokens] = {k: statistics.median(v) for k, v in samples.items()}
        if rank == 0:
            out.update(results)
    finally:
        dist.destroy_process_group()


def hidden_percent(with_comm: float, compute: float, comm: float) -> float:
    """Share of the communication time that did not add to the step's time."""
    return 100 * (compute + comm - with_comm) / comm if comm > 0 else float("nan")


def report(results: dict, args: argparse.Namespace) -> None:
    print(f"model {args.model}, T={args.tp}, {args.device}, {args.threads} thread(s) a rank, "
          f"median of {args.rounds} rounds x {args.repeats} steps (ms per step)")
    print("| tokens | overlap | with comm ms | compute ms | comm alone ms | hidden % |")
    print("|---|---|---|---|---|---|")
    for tokens, r in results.items():
        for mode in ("off", "on"):
            with_comm, compute, comm = r[f"{mode} with comm"], r[f"{mode} compute"], r[f"{mode} comm alone"]
            print(f"| {tokens} | {mode} | {with_comm * 1e3:.2f} | {compute * 1e3:.2f} | {comm * 1e3:.2f} "
                  f"| {hidden_percent(with_comm, compute, comm):.0f} |")


def cmd_comm(args: argparse.Namespace) -> int:
    """Start ``args.tp`` ranks, measure, print the table (flags: ``treadle bench comm --help``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    manager = mp.get_context("spawn").Manager()
    out = manager.dict()
    mp.start_processes(rank_main, args=(args, addr, out), nprocs=args.tp, start_method="spawn", join=True)
    results = dict(out)
    report(results, args)
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump({str(k): v for k, v in results.items()}, f, indent=1)
    return 0
