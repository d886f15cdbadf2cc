"""Prometheus metrics for one app, in its own CollectorRegistry (no global state).

Request-level counters and histograms are updated as requests finish; engine
gauges (running, waiting, KV usage, preemptions, steps, tokens) are read at scrape
time from the snapshot the engine loop publishes (each step, from the engine thread
or the engine-core process), so scraping never touches the engine.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from treadle.engine.client.engine_client import EngineClient
from treadle.engine.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


_KV_TRANSFER_COUNTERS = (
    ("loads", "num_loads", "Consumer: prompts whose KV arrived from a producer."),
    ("recomputes", "num_recomputes", "Consumer: prompts recomputed here because their KV transfer failed."),
    ("received_bytes", "num_bytes_received", "Consumer: KV bytes received."),
    ("pulled", "num_pulled", "Producer: held KV taken by a consumer."),
    ("expired", "num_expired", "Producer: held KV freed after producer_block_timeout_s, never pulled."),
    ("released", "num_released", "Producer: held KV freed unpulled when a consumer or the router released it."),
)


class _EngineCollector:
    """Gauges read at scrape time from the snapshot the engine loop last published
    (in this process, or received from the engine-core process)."""

    def __init__(self, llm: EngineClient, model: str, in_flight: Callable[[], int]) -> None:
        self.llm, self.model, self.in_flight = llm, model, in_flight

    def collect(self) -> Iterator[Metric]:
        snap = self.llm.snapshot
        gauges = [
            ("treadle:num_requests_running", "Sequences in the running batch.", snap.num_running),
            ("treadle:num_requests_waiting", "Sequences waiting to be scheduled.", snap.num_waiting),
            ("treadle:num_requests_open", "Requests admitted by the server and not yet finished.", self.in_flight()),
            ("treadle:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", snap.kv_usage),
            ("treadle:kv_cache_free_blocks", "KV blocks free (or holding only cached prefixes).",
             snap.num_free_blocks),
            ("treadle:kv_cache_total_blocks", "KV blocks in the cache.", snap.num_blocks),
            ("treadle:engine_alive", "1 while the engine step loop is alive.", int(self.llm.is_alive())),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model], float(value))
            yield g
        for name, doc, value in [
            ("treadle:num_preemptions", "Sequences preempted (recomputed later).", snap.num_preemptions),
            ("treadle:engine_steps", "Engine steps run.", snap.num_steps),
            ("treadle:engine_generated_tokens", "Tokens sampled by the engine (aborted requests too).",
             snap.num_generated_tokens),
            ("treadle:engine_computed_tokens", "Tokens run through the model (prompt, recompute, decode).",
             snap.num_computed_tokens),
        ]:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model], float(value))
            yield c
        if snap.spec_decode is not None:
            yield from self._spec_decode(snap.spec_decode)
        if snap.kv_transfer is not None:
            yield from self._kv_transfer(snap.kv_transfer)

    def _kv_transfer(self, kv: dict) -> Iterator[Metric]:
        """P/D disaggregation: transfers, recomputes after failed ones, held blocks."""
        for name, key, doc in _KV_TRANSFER_COUNTERS:
            c = CounterMetricFamily(f"treadle:kv_transfer_{name}", doc, labels=["model_name"])
            c.add_metric([self.model], float(kv[key]))
            yield c
        for name, key, doc in (("held_requests", "num_held", "Producer: requests whose KV blocks wait to be pulled."),
                               ("loading_requests", "num_loading", "Consumer: requests waiting for their KV.")):
            g = GaugeMetricFamily(f"treadle:kv_transfer_{name}", doc, labels=["model_name"])
            g.add_metric([self.model], float(kv[key]))
            yield g

    def _spec_decode(self, spec: dict) -> Iterator[Metric]:
        """vLLM's spec_decode_* counters with our prefix, and the fallback controller's decisions."""
        for key, name, doc in _SPEC_COUNTERS:
            c = CounterMetricFamily(f"treadle:spec_decode_{name}", doc, labels=["model_name"])
            c.add_metric([self.model], float(spec[key]))
            yield c
        per_pos = CounterMetricFamily("treadle:spec_decode_num_accepted_tokens_per_pos",
                                      "Drafts accepted at each draft position.", labels=["model_name", "position"])
        for pos, value in enumerate(spec["accepted_per_position"]):
            per_pos.add_metric([self.model, str(pos)], float(value))
        yield per_pos
        g = GaugeMetricFamily("treadle:spec_decode_mean_acceptance_length",
                              "Tokens emitted per verify (1 + accepted drafts).", labels=["model_name"])
        g.add_metric([self.model], float(spec["mean_acceptance_length"]))
        yield g


_SPEC_COUNTERS = (
    ("drafts", "num_drafts", "Verifies of a request with at least one draft."),
    ("draft_tokens", "num_draft_tokens", "Draft tokens verified."),
    ("accepted_tokens", "num_accepted_tokens", "Draft tokens accepted."),
    ("emitted_tokens", "num_emitted_tokens", "Tokens emitted by verifies (accepted + correction or bonus)."),
    ("batch_fallbacks", "num_batch_fallbacks", "Steps whose drafts were dropped: speculation did not pay "
                                                "at that batch size."),
    ("request_fallbacks", "num_request_fallbacks", "Requests switched off for low acceptance."),
    ("probes", "num_probes", "Steps or requests that re-measured speculation or plain decoding."),
)


class ServerMetrics:
    def __init__(self, llm: EngineClient, model: str) -> None:
        self.registry = CollectorRegistry()
        self.model = model
        labels = ["model_name"]
        reg = self.registry
        self.finished = Counter("treadle:request_success", "Finished sequences (choices) by finish reason.",
                                labels + ["finished_reason"], registry=reg)
        self.prompt_tokens = Counter("treadle:prompt_tokens", "Prompt tokens of finished requests.", labels,
                                     registry=reg)
        self.generation_tokens = Counter("treadle:generation_tokens", "Tokens generated.", labels, registry=reg)
        self.ttft = Histogram("treadle:time_to_first_token_seconds", "Arrival to first generated token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=reg)
        self.tpot = Histogram("treadle:time_per_output_token_seconds", "Mean time between generated tokens.",
                              labels, buckets=_TOKEN_BUCKETS, registry=reg)
        self.e2e = Histogram("treadle:e2e_request_latency_seconds", "Arrival to the last token.", labels,
                             buckets=_LATENCY_BUCKETS, registry=reg)
        reg.register(_EngineCollector(llm, model, lambda: llm.num_open_requests))

    def observe_finished(self, out: RequestOutput) -> None:
        """One engine request (one prompt, n choices) has finished."""
        m = self.model
        num_generated = [len(c.token_ids) for c in out.outputs]
        for c in out.outputs:
            self.finished.labels(m, c.finish_reason or "abort").inc()
        self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
        self.generation_tokens.labels(m).inc(sum(num_generated))
        metrics = out.metrics
        if metrics is None or metrics.first_token_time is None:
            return
        self.ttft.labels(m).observe(metrics.first_token_time - metrics.arrival_time)
        if metrics.finished_time is not None:
            self.e2e.labels(m).observe(metrics.finished_time - metrics.arrival_time)
            longest = max(num_generated, default=0)
            if longest > 1:
                self.tpot.labels(m).observe((metrics.finished_time - metrics.first_token_time) / (longest - 1))

    def observe_aborted(self, num_sequences: int) -> None:
        """Requests dropped before finishing (client gone, shutdown)."""
        if num_sequences:
            self.finished.labels(self.model, "abort").inc(num_sequences)

    def render(self) -> bytes:
        return generate_latest(self.registry)
