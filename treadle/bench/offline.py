"""`bench throughput` and `bench latency`: every backend on the same seeded
workload, interleaved run by run (so machine drift hits them alike), medians
over repeats with the min-max, each backend's ratio to Treadle, and the
roofline fractions."""
from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from treadle.bench.backends import Backend, make_backend
from treadle.bench.metrics import KVWaste, RequestRecord, ServeMetrics, Spread, summarize
from treadle.bench.report import fmt_pct, fmt_ratio, markdown_table
from treadle.bench.roofline import MachinePeaks, ModelShape, Roofline, remeasure
from treadle.bench.workloads import BenchRequest, LengthRange, WorkloadSpec, make_workload


@dataclass
class RunSummary:
    backend: str
    concurrency: int
    repeat: int
    metrics: ServeMetrics
    kv: KVWaste | None
    roofline_fraction: float | None  # bound time / measured time


@dataclass
class OfflineSetup:
    spec: WorkloadSpec
    vocab_size: int
    max_len: int
    backends: list[Backend]
    shape: ModelShape
    peaks: MachinePeaks | None
    tokenizer: Any = None  # the grounded workload's prompts are text
    runs: list[RunSummary] = field(default_factory=list)
    records: dict[str, list[RequestRecord]] = field(default_factory=dict)  # for CDFs: last run per backend


def build_backends(names: Sequence[str], engine_kwargs: dict[str, Any], n_ctx: int) -> list[Backend]:
    out: list[Backend] = []
    for name in names:
        try:
            out.append(make_backend(name, engine_kwargs, n_ctx))
        except RuntimeError as e:  # an optional peer that is not installed or cannot load this model
            print(f"skipping backend {name}: {e}", file=sys.stderr)
    return out


def roofline_for(setup: OfflineSetup, backend: Backend, dtype_bytes: int) -> Roofline | None:
    if setup.peaks is None or backend.weight_bytes is None:
        return None
    kv_elem = 2 if backend.name.startswith("llamacpp") else dtype_bytes  # llama.cpp keeps an f16 KV cache
    shape = ModelShape(setup.shape.linear_params, setup.shape.num_layers, setup.shape.q_width,
                       setup.shape.kv_bytes_per_token // 4 * kv_elem, setup.shape.lm_head_params)
    return Roofline(setup.peaks, shape, backend.weight_bytes)


def speculation_report(backends: Sequence[Backend]) -> str:
    """One line per speculating Treadle backend: its spec_decode counters over every run
    (warm-up included)."""
    lines = []
    for b in backends:
        stats = getattr(getattr(b, "engine", None), "stats", None)
        spec = stats.spec_decode if stats is not None else None
        if spec is None:
            continue
        d = spec.as_dict()
        lines.append(f"{b.name} speculation: mean acceptance length {d['mean_acceptance_length']:.2f} "
                     f"({d['accepted_tokens']}/{d['draft_tokens']} drafts accepted, {d['emitted_tokens']} tokens "
                     f"from {d['drafts']} verifies), accepted by position {d['accepted_per_position']}, "
                     f"fallbacks: batch {d['batch_fallbacks']}, request {d['request_fallbacks']}, "
                     f"probes {d['probes']}")
    return "\n".join(lines)


def spec_stats(backends: Sequence[Backend]) -> dict[str, Any]:
    out = {}
    for b in backends:
        stats = getattr(getattr(b, "engine", None), "stats", None)
        if stats is not None and stats.spec_decode is not None:
            out[b.name] = stats.spec_decode.as_dict()
    return out


def warm_up(backends: Sequence[Backend], vocab_size: int) -> None:
    spec = WorkloadSpec("fixed", 2, input_len=LengthRange(16, 16), output_len=LengthRange(4, 4), seed=12345)
    reqs = make_workload(spec, vocab_size)
    for b in backends:
        if getattr(b, "batch1_only", False):  # llamacpp-lookup: one sequence at a time
            b.run(reqs[:1], 1)
        else:
            b.run(reqs, 2)


def run_throughput(setup: OfflineSetup, concurrencies: Sequence[int], repeats: int, dtype_bytes: int) -> None:
    total = len(concurrencies) * repeats * len(setup.backends) * setup.spec.num_prompts
    done: list[tuple[RunSummary, Backend, list[BenchRequest], float]] = []
    with tqdm(total=total, desc="bench throughput", unit="req", file=sys.stderr) as bar:
        for ci, c in enumerate(concurrencies):
            for rep in range(repeats):  # fresh token ids per run: no prefix-cache hits from an earlier run
                salt = 1 + rep + ci * repeats
                reqs = make_workload(setup.spec, setup.vocab_size, setup.max_len, token_salt=salt,
                                     tokenizer=setup.tokenizer)
                order = setup.backends[rep % len(setup.backends):] + setup.backends[: rep % len(setup.backends)]
                for b in order:
                    bar.set_postfix_str(f"{b.name} c={c} rep={rep}")
                    res = b.run(reqs, c, bar.update)
                    run = RunSummary(b.name, c, rep, summarize(res.records, res.duration_s), res.kv, None)
                    setup.runs.append(run)
                    setup.records[b.name] = res.records
                    done.append((run, b, reqs, res.duration_s))
    if setup.peaks is not None:
        setup.peaks = remeasure(setup.peaks)
    for run, b, reqs, duration in done:
        roof = roofline_for(setup, b, dtype_bytes)
        run.roofline_fraction = roof.workload_time(reqs, run.concurrency) / duration if roof else None


def spread(runs: Sequence[RunSummary], backend: str, c: int, key: str) -> Spread:
    vals = [_value(r, key) for r in runs if r.backend == backend and r.concurrency == c]
    return Spread.of([v for v in vals if v is not None])


def _value(r: RunSummary, key: str) -> float | None:
    if key == "roofline":
        return r.roofline_fraction
    if key == "kv_waste":
        return r.kv.waste_fraction if r.kv else None
    if key in ("ttft_p50", "tpot_p50"):
        return (r.metrics.ttft_ms if key == "ttft_p50" else r.metrics.tpot_ms).median
    return float(getattr(r.metrics, key))


def reference_backend(names: Sequence[str]) -> str | None:
    """The backend ratios are taken against: the first Treadle (continuous) one listed."""
    return next((n for n in names if n.partition("+")[0] in ("treadle", "treadle-nospec")), None)


def throughput_table(setup: OfflineSetup, concurrencies: Sequence[int]) -> str:
    names = [b.name for b in setup.backends]
    ref_name = reference_backend(names)
    header = ["conc", "backend", "output tok/s", f"vs {ref_name}", "total tok/s", "req/s", "TTFT p50 ms",
              "TPOT p50 ms", "roofline", "KV waste @peak"]
    rows = []
    for c in concurrencies:
        ref = spread(setup.runs, ref_name, c, "output_throughput").median if ref_name else float("nan")
        for name in names:
            out = spread(setup.runs, name, c, "output_throughput")
            roof, waste = spread(setup.runs, name, c, "roofline"), spread(setup.runs, name, c, "kv_waste")
            rows.append([str(c), name, out.fmt(1), fmt_ratio(out.median, ref),
                         spread(setup.runs, name, c, "total_token_throughput").fmt(1),
                         spread(setup.runs, name, c, "request_throughput").fmt(2),
                         spread(setup.runs, name, c, "ttft_p50").fmt(0), spread(setup.runs, name, c, "tpot_p50").fmt(1),
                         fmt_pct(roof.median), fmt_pct(waste.median)])
    return markdown_table(header, rows)


@dataclass
class LatencyRow:
    backend: str
    ttft_ms: Spread
    tpot_ms: Spread
    prompt_tok_s: Spread
    decode_tok_s: Spread
    decode_fraction: float | None  # of the bandwidth bound at batch 1
    prefill_fraction: float | None  # of the compute bound


def run_latency(setup: OfflineSetup, iters: int, dtype_bytes: int) -> list[LatencyRow]:
    """Each backend gets one request at a time, ``iters`` times, interleaved."""
    per: dict[str, list[RequestRecord]] = {b.name: [] for b in setup.backends}
    with tqdm(total=iters * len(setup.backends), desc="bench latency", unit="req", file=sys.stderr) as bar:
        for it in range(iters):
            req = make_workload(setup.spec, setup.vocab_size, setup.max_len, token_salt=it + 1,
                                tokenizer=setup.tokenizer)[:1]
            for b in setup.backends:
                per[b.name] += b.run(req, 1).records
                bar.update(1)
    if setup.peaks is not None:
        setup.peaks = remeasure(setup.peaks)
    rows = []
    for b in setup.backends:
        recs = per[b.name]
        setup.records[b.name] = recs
        ttft = [r.ttft for r in recs]
        tpot = [t for t in (r.tpot for r in recs) if t]
        roof = roofline_for(setup, b, dtype_bytes)
        p, o = setup.spec.input_len.hi, setup.spec.output_len.hi
        row = LatencyRow(b.name, Spread.of([t * 1000 for t in ttft]), Spread.of([t * 1000 for t in tpot]),
                         Spread.of([p / t for t in ttft]), Spread.of([1 / t for t in tpot]), None, None)
        if roof:
            row.decode_fraction = row.decode_tok_s.median / roof.decode_tokens_per_s(1, p + o / 2)
            row.prefill_fraction = row.prompt_tok_s.median / roof.prefill_tokens_per_s(p)
        rows.append(row)
    return rows


def latency_table(rows: Sequence[LatencyRow]) -> str:
    ref_name = reference_backend([r.backend for r in rows])
    ref = next((r.decode_tok_s.median for r in rows if r.backend == ref_name), float("nan"))
    header = ["backend", "TTFT ms", "TPOT ms", "decode tok/s", f"vs {ref_name}", "prompt tok/s",
              "decode / BW bound", "prefill / compute bound"]
    return markdown_table(header, [
        [r.backend, r.ttft_ms.fmt(1), r.tpot_ms.fmt(2), r.decode_tok_s.fmt(1), fmt_ratio(r.decode_tok_s.median, ref),
         r.prompt_tok_s.fmt(0), fmt_pct(r.decode_fraction), fmt_pct(r.prefill_fraction)] for r in rows])
