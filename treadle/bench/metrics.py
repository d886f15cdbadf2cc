"""Per-request timelines and the serving metrics computed from them.

The definitions follow `vllm bench serve`, so figures are comparable:

- TTFT: first chunk received - request sent.
- E2E latency: last chunk received - request sent.
- TPOT (per request): (E2E - TTFT) / (output_tokens - 1), only for requests
  with more than one output token. Mean/median/percentiles are over requests.
- ITL: every gap between two consecutive chunks, pooled over all requests
  (a chunk may carry several tokens; ITL is then per chunk, TPOT per token).
- Throughput: completed requests, output tokens and prompt+output tokens
  divided by the benchmark's wall time (first send to last receive).
- Goodput: completed requests / wall time, counting only requests meeting
  every given SLO (TTFT, TPOT, E2E, in ms); a request with one output token
  counts as TPOT 0 for this purpose.
- Percentiles: linear interpolation between closest ranks (numpy's default).
  An empty list gives 0 for every statistic, as vLLM prints it.

::

    sent         chunk0      chunk1   chunk2 ... chunkN
     |-----TTFT----|--itl0------|--itl1--|       |
     |--------------------- E2E -----------------|
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from treadle.bench import BenchError

SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    """One request's timeline, all times in seconds on one monotonic clock."""

    prompt_len: int
    start: float  # when the request was sent (or handed to the engine)
    chunk_times: list[float] = field(default_factory=list)  # when each chunk of output arrived
    output_tokens: int | None = None  # from the server's usage; None -> one token per chunk
    success: bool = True
    error: str = ""

    @property
    def num_output_tokens(self) -> int:
        return self.output_tokens if self.output_tokens is not None else len(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2el(self) -> float:
        return self.chunk_times[-1] - self.start

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """None when there is a single output token (no decode interval)."""
        n = self.num_output_tokens
        return (self.e2el - self.ttft) / (n - 1) if n > 1 else None


@dataclass
class KVWaste:
    """KV slots allocated to running requests vs slots holding a token, at the
    step where the allocation peaked."""

    peak_allocated_slots: int = 0
    used_slots_at_peak: int = 0
    total_slots: int = 0

    @property
    def waste_fraction(self) -> float:
        alloc = self.peak_allocated_slots
        return (alloc - self.used_slots_at_peak) / alloc if alloc else 0.0

    def observe(self, allocated: int, used: int) -> None:
        if allocated > self.peak_allocated_slots:
            self.peak_allocated_slots, self.used_slots_at_peak = allocated, used


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration_s: float
    kv: KVWaste | None = None


@dataclass
class Distribution:
    """Mean, median, std and chosen percentiles of one latency, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: dict[str, float]  # "p90" -> ms

    @staticmethod
    def of(values_s: Sequence[float], percentiles: Sequence[float]) -> Distribution:
        arr = np.asarray(values_s, dtype=np.float64) * 1000.0 if len(values_s) else np.zeros(1)
        return Distribution(
            mean=float(arr.mean()), median=float(np.median(arr)), std=float(arr.std()),
            percentiles={percentile_name(p): float(np.percentile(arr, p)) for p in percentiles},
        )


def percentile_name(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


@dataclass
class ServeMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # req/s
    request_goodput: float | None  # good req/s; None without SLOs
    output_throughput: float  # output tok/s
    total_token_throughput: float  # (prompt + output) tok/s
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2el_ms: Distribution
    max_concurrency_seen: int


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise BenchError(f"goodput SLO {item!r}: write NAME:MS with NAME one of {', '.join(SLO_METRICS)}")
        ms = float(value)
        if not math.isfinite(ms) or ms < 0:
            raise BenchError(f"goodput SLO {item!r}: the value must be a non-negative number of ms")
        slos[name] = ms
    return slos


def meets_slos(rec: RequestRecord, slos: dict[str, float]) -> bool:
    values = {"ttft": rec.ttft, "tpot": rec.tpot or 0.0, "e2el": rec.e2el}
    return all(values[name] * 1000.0 <= ms for name, ms in slos.items())


def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """Most requests in flight at once (half-open [start, end) intervals)."""
    events = sorted([(r.start, 1) for r in records] + [(r.chunk_times[-1], -1) for r in records])
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    percentiles: Sequence[float] = (50, 90, 99),
    slos: dict[str, float] | None = None,
) -> ServeMetrics:
    ok = [r for r in records if r.success and r.chunk_times]
    if duration_s <= 0:
        raise BenchError("the benchmark duration must be positive")
    out_tokens = sum(r.num_output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpots = [t for t in (r.tpot for r in ok) if t is not None]
    itls = [gap for r in ok for gap in r.itls]
    good = sum(meets_slos(r, slos) for r in ok) if slos else None
    return ServeMetrics(
        completed=len(ok), failed=len(records) - len(ok), duration_s=duration_s,
        total_input_tokens=in_tokens, total_output_tokens=out_tokens,
        request_throughput=len(ok) / duration_s,
        request_goodput=None if good is None else good / duration_s,
        output_throughput=out_tokens / duration_s,
        total_token_throughput=(in_tokens + out_tokens) / duration_s,
        ttft_ms=Distribution.of([r.ttft for r in ok], percentiles),
        tpot_ms=Distribution.of(tpots, percentiles),
        itl_ms=Distribution.of(itls, percentiles),
        e2el_ms=Distribution.of([r.e2el for r in ok], percentiles),
        max_concurrency_seen=peak_concurrency(ok) if ok else 0,
    )


@dataclass
class Spread:
    """Median over repeats with the min and max, for the result tables."""

    median: float
    lo: float
    hi: float

    @staticmethod
    def of(values: Sequence[float]) -> Spread:
        if not values:
            return Spread(float("nan"), float("nan"), float("nan"))
        return Spread(float(np.median(values)), float(min(values)), float(max(values)))

    def fmt(self, digits: int = 1) -> str:
        if self.lo == self.hi:
            return f"{self.median:.{digits}f}"
        return f"{self.median:.{digits}f} ({self.lo:.{digits}f}-{self.hi:.{digits}f})"
