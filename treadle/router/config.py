"""The router's settings: a frozen dataclass built once from the command line."""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Role(StrEnum):
    PREFILL = "prefill"  # a kv_producer: computes the prompt and hands its KV over
    DECODE = "decode"  # a kv_consumer: pulls the KV and generates
    BACKEND = "backend"  # a plain colocated instance


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    backend: tuple[str, ...] = ()
    poll_interval_s: float = 0.5  # /health and /load of every instance
    poll_timeout_s: float = 2.0
    connect_timeout_s: float = 3.0
    upstream_timeout_s: float = 300.0  # the longest wait for one response or one streamed event
    max_attempts: int = 3  # instances tried for one step of a request
    max_failures: int = 5  # consecutive failures (one per back-off) that take an instance out of rotation
    retry_backoff_s: float = 1.0  # first back-off of a failing instance, doubled after each failure
    prefix_affinity: bool = True
    balance_by_cost: bool = True  # by the instances' predicted remaining tokens where they report them
    queue: str = "off"  # the dispatch queue (router/queue.py): off, fcfs or predicted
    queue_aging_s: float = 120.0  # predicted: nobody is passed over by a request arriving this much later
    queue_max_passed_over: int | None = None  # predicted: passed over this often, a request goes first
    # (None: 20 per generating instance, so the bound means in time what the engine's 20 does)

    def __post_init__(self) -> None:
        if self.backend and (self.prefill or self.decode):
            raise ValueError("give either --backend, or --prefill and --decode, not both")
        if not self.backend and not (self.prefill and self.decode):
            raise ValueError("give --backend URL..., or --prefill URL... and --decode URL...")
        if self.max_failures < 1 or not self.retry_backoff_s > 0:
            raise ValueError("--max-failures must be at least 1 and --retry-backoff above 0")
        if self.queue not in ("off", "fcfs", "predicted"):
            raise ValueError(f"--queue must be off, fcfs or predicted, not {self.queue!r}")
        if not self.queue_aging_s > 0 or (self.queue_max_passed_over or 0) < 0:
            raise ValueError("--queue-aging-s must be above 0 and --queue-max-passed-over at least 0")
        urls = [*self.prefill, *self.decode, *self.backend]
        if len(set(urls)) != len(urls):
            raise ValueError("an instance URL is given twice")

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill)

    @property
    def generating_role(self) -> Role:
        """The role of the instances whose output the client receives."""
        return Role.DECODE if self.disaggregated else Role.BACKEND

    @property
    def prompt_role(self) -> Role:
        """The role of the instances that compute prompts (where a prefix cache pays)."""
        return Role.PREFILL if self.disaggregated else Role.BACKEND

    def instances(self) -> list[tuple[str, Role]]:
        return ([(u, Role.PREFILL) for u in self.prefill] + [(u, Role.DECODE) for u in self.decode]
                + [(u, Role.BACKEND) for u in self.backend])
