"""The router's Prometheus metrics, in its own registry: upstream requests per instance
and outcome, retries, routing decisions, prefill fall-backs, KV releases, errors after a stream began,
the dispatch queue's waits, and (read at scrape time) each instance's health and in-flight count."""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from treadle.router.instances import Instance, InstancePool

if TYPE_CHECKING:
    from treadle.router.queue import DispatchQueue


class _InstanceCollector:
    def __init__(self, pool: InstancePool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        rows: list[tuple[str, str, list[tuple[Instance, float]]]] = [
            ("treadle:router_instance_healthy", "1 while the instance has no failure since its last good health "
             "check or answer.", [(i, float(i.healthy)) for i in self.pool.instances]),
            ("treadle:router_instance_failures", "Consecutive failures of the instance (one per back-off); at "
             "--max-failures it is out of rotation.", [(i, float(i.failures)) for i in self.pool.instances]),
            ("treadle:router_instance_in_flight", "Requests sent to the instance and not finished.",
             [(i, float(i.in_flight)) for i in self.pool.instances]),
            ("treadle:router_instance_running", "Requests running on the instance, as its last poll reported.",
             [(i, float(i.load.running)) for i in self.pool.instances]),
        ]
        for name, doc, values in rows:
            g = GaugeMetricFamily(name, doc, labels=["instance", "role"])
            for inst, value in values:
                g.add_metric([inst.url, inst.role.value], value)
            yield g


class RouterMetrics:
    def __init__(self, pool: InstancePool) -> None:
        self.registry = reg = CollectorRegistry()
        self.upstream = Counter("treadle:router_upstream_requests", "Requests sent to instances, by outcome "
                                "(ok, client_error: a 4xx passed to the client, failed: retried or given up).",
                                ["instance", "role", "outcome"], registry=reg)
        self.retries = Counter("treadle:router_retries", "Requests sent again to another instance.", ["role"],
                               registry=reg)
        self.decisions = Counter("treadle:router_routing_decisions", "Instances chosen, by reason (load, affinity).",
                                 ["role", "reason"], registry=reg)
        self.prefill_fallbacks = Counter("treadle:router_prefill_fallbacks", "Requests sent to a decode instance "
                                         "without KV because no prefill instance could compute the prompt.",
                                         registry=reg)
        self.stream_errors = Counter("treadle:router_stream_errors", "Streams that failed after their first event "
                                     "(the client got an error event).", registry=reg)
        self.kv_releases = Counter("treadle:router_kv_releases", "Producers told to free a prompt's KV because "
                                   "its decode step never started (the client left, or no decode instance took it).",
                                   registry=reg)
        self.queue_wait = Histogram("treadle:router_queue_wait_seconds", "Time requests waited in the router's "
                                    "dispatch queue (--queue) for a batch slot.", registry=reg,
                                    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300))
        self.queue_waiting = Gauge("treadle:router_queue_waiting", "Requests waiting in the router's dispatch "
                                   "queue (--queue).", registry=reg)
        reg.register(_InstanceCollector(pool))

    def watch_queue(self, queue: DispatchQueue) -> None:
        self.queue_waiting.set_function(lambda: len(queue.waiting))

    def render(self) -> bytes:
        return generate_latest(self.registry)
