"""`treadle bench {throughput,latency,serve,comm,ab}`: parsers and the drivers (comm: bench/comm.py, ab: bench/ab.py)."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from treadle.bench import BACKENDS
from treadle.bench.workloads import WORKLOADS, BenchRequest, LengthRange, WorkloadSpec, make_workload, max_total_len
from treadle.engine.args import EngineArgs
from treadle.engine.cli_args import DEFAULT_MODEL, add_engine_args, engine_kwargs, positive_int

if TYPE_CHECKING:
    from treadle.bench.offline import OfflineSetup



def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_workload_args(p: argparse.ArgumentParser, input_len: str, output_len: str, num_prompts: int) -> None:
    g = p.add_argument_group("workload (seeded; prompts are token ids)")
    g.add_argument("--workload", default="random", choices=WORKLOADS)
    g.add_argument("--input-len", default=input_len, help="prompt tokens: N or LO:HI (uniform)")
    g.add_argument("--output-len", default=output_len, help="output tokens: N or LO:HI (uniform)")
    g.add_argument("--num-prompts", type=positive_int, default=num_prompts)
    g.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: tokens of the shared system prompt")
    g.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix: distinct system prompts")
    g.add_argument("--workload-seed", type=int, default=0)
    g.add_argument("--lengths-file", default=None, metavar="FILE.jsonl",
                   help="lengths: true answer lengths (default: the shipped length predictor's for --model)")
    p.add_argument("--save-result", default=None, metavar="FILE.json")
    p.add_argument("--plot", default=None, metavar="DIR", help="write PNG charts there (needs matplotlib)")


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    lengths = args.lengths_file
    if lengths is None and args.workload == "lengths":
        from treadle.predict.model import shipped_for

        shipped = shipped_for(getattr(args, "model", "") or "")
        lengths = None if shipped is None else str(shipped / "lengths.jsonl")
    return WorkloadSpec(args.workload, args.num_prompts, LengthRange.parse(args.input_len),
                        LengthRange.parse(args.output_len), args.prefix_len, args.num_prefixes, args.workload_seed,
                        lengths)


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks: throughput, latency, serve")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    t = kinds.add_parser("throughput", help="offline throughput, backends side by side")
    add_engine_args(t)
    add_workload_args(t, "32:512", "16:256", 64)
    t.add_argument("--backends", default="treadle,static", help=f"comma list of {','.join(BACKENDS)}")
    t.add_argument("--concurrency", type=int_list, default=[16], help="comma list, e.g. 1,4,16")
    t.add_argument("--repeats", type=positive_int, default=3)
    t.add_argument("--no-roofline", dest="roofline", action="store_false")
    t.set_defaults(func=cmd_throughput)
    lat = kinds.add_parser("latency", help="one request at a time: TTFT, per-token decode latency")
    add_engine_args(lat)
    add_workload_args(lat, "128", "128", 1)
    lat.set_defaults(workload="fixed")
    lat.add_argument("--backends", default="treadle", help=f"comma list of {','.join(BACKENDS)}")
    lat.add_argument("--iters", type=positive_int, default=5)
    lat.add_argument("--no-roofline", dest="roofline", action="store_false")
    lat.set_defaults(func=cmd_latency)
    s = kinds.add_parser("serve", help="load an OpenAI-compatible server (ours or another)")
    s.add_argument("--base-url", action="append", required=True, metavar="[LABEL=]URL",
                   help="server root, e.g. http://127.0.0.1:8000 (repeat to compare servers); llamacpp-server "
                        "starts llama.cpp's server on --model's GGUF with one slot per concurrent request")
    s.add_argument("--model", default=DEFAULT_MODEL, help="local model whose vocabulary the prompts use")
    s.add_argument("--served-model-name", default=None, help="model id to send (default: the server's first)")
    s.add_argument("--prompt-format", default="ids", choices=["ids", "text"], help="send token ids or decoded text")
    add_workload_args(s, "32:512", "16:256", 64)
    s.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (inf: all at once)")
    s.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1 = Poisson)")
    s.add_argument("--max-concurrency", type=int_list, default=[0], help="comma list; 0 = unlimited")
    s.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS", help="SLOs, e.g. ttft:500 tpot:50")
    s.add_argument("--percentiles", default="50,90,99")
    s.add_argument("--seed", type=int, default=0, help="seed of the arrival process")
    s.add_argument("--ordering", default="none", choices=["none", "oracle", "random"],
                   help="send a priority per request (for a server run with --scheduling-policy priority): "
                        "oracle: its true cost (output length + prefill at the scheduler's weight); random: seeded")
    s.set_defaults(func=cmd_serve)
    c = kinds.add_parser("comm", help="tensor-parallel communication hidden behind compute, overlap off vs on")
    c.add_argument("--model", default=DEFAULT_MODEL)
    c.add_argument("-tp", "--tensor-parallel-size", dest="tp", type=int, default=2)
    c.add_argument("--tokens", type=int_list, default=[16, 64], help="tokens a step, comma list")
    c.add_argument("--rounds", type=positive_int, default=5, help="alternating rounds (medians over them)")
    c.add_argument("--repeats", type=positive_int, default=10, help="steps timed per round")
    c.add_argument("--threads", type=positive_int, default=1, help="threads a rank")
    c.add_argument("--device", default="cpu")
    c.add_argument("--save-result", default=None, metavar="FILE.json")
    c.set_defaults(func=cmd_comm)
    ab = kinds.add_parser("ab", help="two engine configurations, decode steps interleaved in one process")
    add_engine_args(ab)
    ab.add_argument("--a", default=None, metavar="JSON", help="engine arguments of side A over the flags")
    ab.add_argument("--b", default=None, metavar="JSON", help="engine arguments of side B over the flags")
    ab.add_argument("--a-env", action="append", default=[], metavar="NAME=VALUE", help="side A's environment")
    ab.add_argument("--b-env", action="append", default=[], metavar="NAME=VALUE", help="side B's environment")
    ab.add_argument("--batch", type=positive_int, nargs="+", default=[1, 4, 16])
    ab.add_argument("--prompt-len", type=positive_int, default=512)
    ab.add_argument("--steps", type=positive_int, default=64, help="decode steps of each side per batch size")
    ab.add_argument("--save-result", default=None, metavar="FILE.json")
    ab.set_defaults(func=cmd_ab)


def cmd_ab(args: argparse.Namespace) -> int:
    import json

    from treadle.bench.ab import Side, run_ab

    sides = (Side.parse("A", args.a, args.a_env), Side.parse("B", args.b, args.b_env))
    results = run_ab(sides, engine_kwargs(args), args.batch, args.prompt_len, args.steps)
    if args.save_result:
        Path(args.save_result).write_text(json.dumps({str(k): v for k, v in results.items()}, indent=1))
    return 0


def cmd_comm(args: argparse.Namespace) -> int:
    from treadle.bench.comm import cmd_comm as run  # torch loads only when the command runs

    return run(args)


def _offline_setup(args: argparse.Namespace, max_concurrency: int) -> tuple[OfflineSetup, int]:
    from treadle.bench import offline
    from treadle.bench.roofline import ModelShape, measure_machine
    from treadle.loaders import open_model_source, parse_dtype

    kw = engine_kwargs(args)
    source = open_model_source(kw["model"])
    cfg, tok = source.config, source.tokenizer
    spec = workload_spec(args)
    max_len = args.max_model_len or min(cfg.max_position_embeddings,
                                        max_total_len(make_workload(spec, cfg.vocab_size, tokenizer=tok,
                                                                     token_salt=-1 if spec.kind in ("grounded", "chat-text") else 0)))
    kw["max_model_len"] = max_len
    given = args.max_num_seqs if args.max_num_seqs != EngineArgs.max_num_seqs else 0
    kw["max_num_seqs"] = max(given, max_concurrency)
    dtype_bytes = parse_dtype(args.dtype).itemsize
    peaks = measure_machine(parse_dtype(args.dtype)) if args.roofline else None
    names = [n.strip() for n in args.backends.split(",") if n.strip()]
    backends = offline.build_backends(names, kw, max_len + 16)
    if not backends:
        raise SystemExit("no backend could be loaded")
    offline.warm_up(backends, cfg.vocab_size)
    shape = ModelShape.from_config(cfg, 4)
    return offline.OfflineSetup(spec, cfg.vocab_size, max_len, backends, shape, peaks, tok), dtype_bytes


def _print_peaks(setup: OfflineSetup) -> None:
    if setup.peaks:
        p = setup.peaks
        print(f"machine: read bandwidth {p.mem_bandwidth / 1e9:.1f} GB/s, {p.dtype} matmul "
              f"{p.matmul_flops / 1e9:.1f} GFLOP/s, {p.threads} threads")
    for b in setup.backends:
        if b.weight_bytes:
            print(f"{b.name}: {b.weight_bytes / 2**20:.1f} MiB of weights read per decode step")


def _print_speculation(setup: OfflineSetup) -> None:
    from treadle.bench import offline

    report = offline.speculation_report(setup.backends)
    if report:
        print(report)


def cmd_throughput(args: argparse.Namespace) -> int:
    from treadle.bench import offline
    from treadle.bench.report import save_result
    setup, dtype_bytes = _offline_setup(args, max(args.concurrency))
    offline.run_throughput(setup, args.concurrency, args.repeats, dtype_bytes)
    print(f"\nworkload: {setup.spec.describe()}; medians over {args.repeats} repeats (min-max)")
    _print_peaks(setup)
    print(offline.throughput_table(setup, args.concurrency))
    _print_speculation(setup)
    if args.plot:
        from treadle.bench import plots

        out = Path(args.plot)
        out.mkdir(parents=True, exist_ok=True)
        curves = {b.name: [(c, offline.spread(setup.runs, b.name, c, "output_throughput")) for c in args.concurrency]
                  for b in setup.backends}
        print("wrote", plots.plot_throughput(curves, out / "throughput_vs_concurrency.png", setup.spec.describe()))
        print("wrote", plots.plot_latency_cdfs(setup.records, out / "latency_cdf.png",
                                               f"{setup.spec.describe()}, concurrency {args.concurrency[-1]}"))
    if args.save_result:
        save_result(args.save_result, {"kind": "throughput", "args": vars_of(args), "workload": setup.spec,
                                       "peaks": setup.peaks, "runs": setup.runs,
                                       "spec_decode": offline.spec_stats(setup.backends)})
    return 0


def cmd_latency(args: argparse.Namespace) -> int:
    from treadle.bench import offline
    from treadle.bench.report import save_result
    setup, dtype_bytes = _offline_setup(args, 1)
    rows = offline.run_latency(setup, args.iters, dtype_bytes)
    print(f"\nbatch 1, prompt {setup.spec.input_len.hi} tokens, {setup.spec.output_len.hi} output tokens; "
          f"medians over {args.iters} requests (min-max)")
    _print_peaks(setup)
    print(offline.latency_table(rows))
    _print_speculation(setup)
    if args.plot:
        from treadle.bench import plots

        Path(args.plot).mkdir(parents=True, exist_ok=True)
        print("wrote", plots.plot_latency_cdfs(setup.records, Path(args.plot) / "latency_batch1_cdf.png",
                                               "batch 1 " + setup.spec.describe()))
    if args.save_result:
        save_result(args.save_result, {"kind": "latency", "args": vars_of(args), "workload": setup.spec,
                                       "peaks": setup.peaks, "rows": rows,
                                       "spec_decode": offline.spec_stats(setup.backends)})
    return 0


def vars_of(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k != "func"}


def _serve_prompts(args: argparse.Namespace, salt: int) -> tuple[list, list]:
    """The workload with token ids drawn for ``salt``: each run gets fresh prompts, so a
    server's prefix cache cannot serve one run from an earlier one."""
    from treadle.loaders import open_model_source

    source = open_model_source(args.model)
    reqs = make_workload(workload_spec(args), source.config.vocab_size, token_salt=salt, tokenizer=source.tokenizer)
    if args.prompt_format == "ids" or source.tokenizer is None:
        return reqs, [r.prompt_token_ids for r in reqs]
    return reqs, [source.tokenizer.decode(r.prompt_token_ids) for r in reqs]


def with_ordering(reqs: list[BenchRequest], ordering: str, seed: int) -> list[BenchRequest]:
    """Priorities for an ordering ablation (lower is served first; 0 is never sent, so every
    priority is at least 1): oracle = the request's true cost in decode-token units."""
    if ordering == "none":
        return reqs
    from treadle.core.cost_policy import PREFILL_TOKEN_COST

    if ordering == "oracle":
        ranks = [1 + round(r.output_len + PREFILL_TOKEN_COST * r.prompt_len) for r in reqs]
    else:
        import numpy as np

        ranks = [1 + int(x) for x in np.random.default_rng(seed).permutation(len(reqs))]
    return [dataclasses.replace(r, priority=p) for r, p in zip(reqs, ranks)]


def cmd_serve(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from treadle.bench.metrics import parse_goodput, summarize
    from treadle.bench.report import markdown_table, save_result, serve_report
    from treadle.bench.serve_client import Traffic, run_serve
    slos = parse_goodput(args.goodput)
    percentiles = [float(p) for p in args.percentiles.split(",")]
    targets = [u.split("=", 1) if "=" in u.split("://")[0] else [u, u] for u in args.base_url]
    results, records, rows = [], {}, []
    for label, url in targets:
        for ci, conc in enumerate(args.max_concurrency):
            reqs, prompts = _serve_prompts(args, salt=ci + 1)  # the same per level for every server
            reqs = with_ordering(reqs, args.ordering, args.seed)
            traffic = Traffic(args.request_rate, args.burstiness, conc or None, args.seed)
            with (_launched(url, args.model, reqs, conc) as base,
                  tqdm(total=len(reqs), desc=f"bench serve {label} c={conc or 'inf'}", file=sys.stderr) as bar):
                recs, dur, model = asyncio.run(run_serve(base, reqs, prompts, traffic, args.served_model_name,
                                                         bar.update))
            m = summarize(recs, dur, percentiles, slos or None)
            desc = f"rate {args.request_rate} req/s, burstiness {args.burstiness}, max concurrency {conc or 'inf'}"
            print(serve_report(f"{label} ({model})", m, desc))
            for r in recs:
                if not r.success:
                    print(f"  failed: {r.error}", file=sys.stderr)
            results.append({"label": label, "url": url, "model": model, "max_concurrency": conc, "metrics": m})
            records[f"{label} c={conc or 'inf'}"] = recs
            rows.append([label, str(conc or "inf"), f"{m.output_throughput:.1f}", f"{m.request_throughput:.2f}",
                         f"{m.ttft_ms.median:.0f}", f"{m.tpot_ms.median:.1f}", f"{m.itl_ms.median:.1f}",
                         "-" if m.request_goodput is None else f"{m.request_goodput:.2f}"])
    print(markdown_table(["server", "max conc", "output tok/s", "req/s", "TTFT p50 ms", "TPOT p50 ms",
                          "ITL p50 ms", "goodput req/s"], rows))
    if args.plot:
        _plot_serve(args, results, records)
    if args.save_result:
        save_result(args.save_result, {"kind": "serve", "args": vars_of(args), "results": results})
    return 0


def _launched(url: str, model: str, reqs: list, conc: int) -> contextlib.AbstractContextManager[str]:
    """``url`` itself, or for ``llamacpp-server`` llama.cpp's server started on ``model``'s GGUF
    with one slot per concurrent request (stopped when the context ends)."""
    if url != "llamacpp-server":
        return contextlib.nullcontext(url)
    from treadle.bench.llamacpp_server import launched_server

    return launched_server(model, slots=conc or len(reqs), ctx_per_slot=max(r.prompt_len + r.output_len for r in reqs) + 16)


def _plot_serve(args: argparse.Namespace, results: list[dict], records: dict) -> None:
    from treadle.bench import plots
    from treadle.bench.metrics import Spread

    out = Path(args.plot)
    out.mkdir(parents=True, exist_ok=True)
    curves: dict[str, list] = {}
    for r in results:
        v = r["metrics"].output_throughput
        curves.setdefault(r["label"], []).append((r["max_concurrency"] or len(records), Spread(v, v, v)))
    print("wrote", plots.plot_throughput(curves, out / "serve_throughput_vs_concurrency.png", "bench serve"))
    print("wrote", plots.plot_latency_cdfs(records, out / "serve_latency_cdf.png", "bench serve"))
