"""What the router knows of each instance, and the poller that keeps it fresh.

Every ``poll_interval_s`` each instance is asked ``GET /health`` and, when healthy,
``GET /load`` (``{"waiting_prompt_tokens", "running", "waiting", "kv_usage", "role",
"predicted_remaining_tokens"}``;
an instance without it is read from its Prometheus ``/metrics``). A failed or non-200
health check takes the instance out of rotation; the next good one puts it back. A
request that cannot reach an instance takes it out at once (``mark_down``).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from treadle.router.config import Role

logger = logging.getLogger("treadle.router")


def describe(e: BaseException) -> str:
    """``ReadError`` or ``ConnectError: All connection attempts failed`` (httpx's texts are often empty)."""
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


@dataclass(frozen=True)
class InstanceLoad:
    """The load an instance last reported."""
    waiting_prompt_tokens: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # 0-1
    predicted_remaining_tokens: int | None = None  # output tokens its requests are predicted to need; None: no predictor

    @staticmethod
    def from_json(data: dict[str, Any]) -> InstanceLoad:
        predicted = data.get("predicted_remaining_tokens")
        return InstanceLoad(int(data.get("waiting_prompt_tokens", 0)), int(data.get("running", 0)),
                            int(data.get("waiting", 0)), float(data.get("kv_usage", 0.0)),
                            None if predicted is None else int(predicted))

    @staticmethod
    def from_metrics(text: str) -> InstanceLoad:
        """The same from ``treadle serve``'s /metrics (which has no queued prompt-token count)."""
        values = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
        return InstanceLoad(0, int(values.get("treadle:num_requests_running", 0)),
                            int(values.get("treadle:num_requests_waiting", 0)),
                            float(values.get("treadle:kv_cache_usage_perc", 0.0)))


class Instance:
    """One upstream server. ``in_flight`` / ``in_flight_prompt_tokens``: requests this
    router has sent and not yet seen finish (exact and immediate, unlike the polled load)."""

    def __init__(self, url: str, role: Role) -> None:
        self.url, self.role = url.rstrip("/"), role
        self.healthy = True  # until the first poll says otherwise
        self.problem: str | None = None
        self.load = InstanceLoad()
        self.load_source = "none"  # "load", "metrics" or "none"
        self.in_flight = 0
        self.in_flight_prompt_tokens = 0

    def begin(self, prompt_tokens: int) -> None:
        self.in_flight += 1
        self.in_flight_prompt_tokens += prompt_tokens

    def end(self, prompt_tokens: int) -> None:
        self.in_flight -= 1
        self.in_flight_prompt_tokens -= prompt_tokens

    def mark_down(self, problem: str) -> None:
        if self.healthy:
            logger.warning("%s instance %s is out of rotation: %s", self.role.value, self.url, problem)
        self.healthy, self.problem = False, problem

    def mark_up(self) -> None:
        if not self.healthy:
            logger.info("%s instance %s is back in rotation", self.role.value, self.url)
        self.healthy, self.problem = True, None

    async def poll(self, client: httpx.AsyncClient, timeout: float) -> None:
        """One health check and, if healthy, one load reading. Never raises. Only /health
        decides health: a load that cannot be read (say, /load behind an API key) keeps the
        last reading."""
        try:
            health = await client.get(f"{self.url}/health", timeout=timeout)
        except httpx.HTTPError as e:
            self.mark_down(describe(e))
            return
        if health.status_code != 200:
            self.mark_down(f"/health answered {health.status_code}")
            return
        self.mark_up()
        try:
            self.load = await self._read_load(client, timeout) or self.load
        except (httpx.HTTPError, ValueError, KeyError) as e:
            logger.debug("%s: load not read (%s)", self.url, describe(e))

    async def _read_load(self, client: httpx.AsyncClient, timeout: float) -> InstanceLoad | None:
        if self.load_source != "metrics":
            resp = await client.get(f"{self.url}/load", timeout=timeout)
            if resp.status_code == 200:
                self.load_source = "load"
                return InstanceLoad.from_json(resp.json())
            if resp.status_code != 404:
                return None
        resp = await client.get(f"{self.url}/metrics", timeout=timeout)
        if resp.status_code != 200:
            return None
        self.load_source = "metrics"
        return InstanceLoad.from_metrics(resp.text)


class InstancePool:
    """All instances, and the task that polls them."""

    def __init__(self, instances: list[Instance], poll_interval_s: float, poll_timeout_s: float) -> None:
        self.instances = instances
        self.poll_interval_s, self.poll_timeout_s = poll_interval_s, poll_timeout_s

    def by_role(self, role: Role) -> list[Instance]:
        return [i for i in self.instances if i.role == role]

    async def poll_all(self, client: httpx.AsyncClient) -> None:
        await asyncio.gather(*(i.poll(client, self.poll_timeout_s) for i in self.instances))

    async def run(self, client: httpx.AsyncClient) -> None:
        """Poll forever (cancelled at shutdown)."""
        while True:
            await self.poll_all(client)
            await asyncio.sleep(self.poll_interval_s)
