"""What the router knows of each instance, and the poller that keeps it fresh.

Every ``poll_interval_s`` each instance is asked ``GET /health`` and, when healthy,
``GET /load`` (``{"waiting_prompt_tokens", "running", "waiting", "kv_usage", "role",
"predicted_remaining_tokens", "max_num_seqs"}``;
an instance without it is read from its Prometheus ``/metrics``).

Failures (a failed or non-200 health check, a request that cannot reach the instance) are
counted, once per back-off period, and a good health check (or answer) clears them:

```
 failures  0            1 .. max_failures-1                  max_failures
           healthy  ->  backing off: skipped while others   ->  out of rotation: requests
                        of its role are healthy; the only       fail at once (503) until a
                        ones left are retried after             health check passes
                        backoff_s * 2**(failures-1)
```

So one connection error or slow health check never takes the last instance of a role away:
an instance frozen for less than the back-off window (``FailurePolicy.window_s``) costs
requests only their wait.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
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
    max_num_seqs: int | None = None  # its batch slots; None: not reported

    @staticmethod
    def from_json(data: dict[str, Any]) -> InstanceLoad:
        predicted, slots = data.get("predicted_remaining_tokens"), data.get("max_num_seqs")
        return InstanceLoad(int(data.get("waiting_prompt_tokens", 0)), int(data.get("running", 0)),
                            int(data.get("waiting", 0)), float(data.get("kv_usage", 0.0)),
                            None if predicted is None else int(predicted), None if slots is None else int(slots))

    @staticmethod
    def from_metrics(text: str) -> InstanceLoad:
        """The same from ``treadle serve``'s /metrics (which has no queued prompt-token count)."""
        values = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
        return InstanceLoad(0, int(values.get("treadle:num_requests_running", 0)),
                            int(values.get("treadle:num_requests_waiting", 0)),
                            float(values.get("treadle:kv_cache_usage_perc", 0.0)))


@dataclass(frozen=True)
class FailurePolicy:
    """How long a failing instance keeps its place before it leaves rotation."""
    max_failures: int = 5  # consecutive failures (counted once per back-off) that take an instance out
    backoff_s: float = 1.0  # the back-off after the first failure, doubled after each further one

    def backoff_after(self, failures: int) -> float:
        return self.backoff_s * 2 ** (failures - 1)

    @property
    def window_s(self) -> float:
        """The shortest time from an instance's first failure to its leaving rotation."""
        return sum(self.backoff_after(f) for f in range(1, self.max_failures))


class Instance:
    """One upstream server. ``in_flight`` / ``in_flight_prompt_tokens``: requests this
    router has sent and not yet seen finish (exact and immediate, unlike the polled load)."""

    def __init__(self, url: str, role: Role, policy: FailurePolicy = FailurePolicy()) -> None:
        self.url, self.role, self.policy = url.rstrip("/"), role, policy
        self.failures = 0  # consecutive, counted once per back-off period
        self.retry_at = 0.0  # time.monotonic() before which a backing-off instance is not retried
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

    @property
    def healthy(self) -> bool:
        """No failure since its last good health check or answer: first choice for requests."""
        return self.failures == 0

    @property
    def out(self) -> bool:
        """Out of rotation: ``max_failures`` consecutive failures; only a good health check brings it back."""
        return self.failures >= self.policy.max_failures

    @property
    def backing_off(self) -> bool:
        return 0 < self.failures < self.policy.max_failures

    def retry_due(self, now: float) -> bool:
        """A backing-off instance whose back-off has passed (or one that is healthy again)."""
        return self.healthy or (self.backing_off and now >= self.retry_at)

    def mark_down(self, problem: str, now: float | None = None) -> None:
        """One failure; failures within the back-off after the last counted one are the same
        outage (a burst of requests failing together counts once)."""
        now = time.monotonic() if now is None else now
        self.problem = problem
        if self.out or (self.failures and now < self.retry_at):
            return
        self.failures += 1
        self.retry_at = now + self.policy.backoff_after(self.failures)
        if self.out:
            logger.warning("%s instance %s is out of rotation after %d consecutive failures: %s", self.role.value,
                           self.url, self.failures, problem)
        elif self.failures == 1:
            logger.warning("%s instance %s failed (%s); retried with back-off, out of rotation after %d "
                           "consecutive failures", self.role.value, self.url, problem, self.policy.max_failures)

    def mark_up(self) -> None:
        if self.failures:
            logger.info("%s instance %s is back in rotation", self.role.value, self.url)
        self.failures, self.problem = 0, None

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
        self.after_poll: list[Callable[[], None]] = []  # called after every round of polls

    def by_role(self, role: Role) -> list[Instance]:
        return [i for i in self.instances if i.role == role]

    async def poll_all(self, client: httpx.AsyncClient) -> None:
        await asyncio.gather(*(i.poll(client, self.poll_timeout_s) for i in self.instances))
        for callback in self.after_poll:
            callback()

    async def run(self, client: httpx.AsyncClient) -> None:
        """Poll forever (cancelled at shutdown)."""
        while True:
            await self.poll_all(client)
            await asyncio.sleep(self.poll_interval_s)
