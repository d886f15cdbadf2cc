"""The router's failure counting and back-off on hand-built instances (no servers): failures
count once per back-off period, a good check clears them, and a step whose only generating
instance fails is retried as the back-off allows, then refused by name once it is out."""
from __future__ import annotations

import asyncio
import time

import pytest

from treadle.router.config import Role, RouterConfig
from treadle.router.forward import Forwarder
from treadle.router.instances import FailurePolicy, Instance, InstancePool
from treadle.router.metrics import RouterMetrics
from treadle.router.policy import choose
from treadle.router.upstream import Job, Relay, UpstreamFailure

POLICY = FailurePolicy(max_failures=4, backoff_s=0.05)


def test_failures_count_once_per_backoff_and_a_good_check_clears_them():
    inst = Instance("http://a", Role.DECODE, FailurePolicy(max_failures=4, backoff_s=0.5))
    assert FailurePolicy(4, 0.5).window_s == 0.5 + 1.0 + 2.0
    inst.mark_down("refused", now=0.0)
    inst.mark_down("refused", now=0.4)  # the same outage (a burst of requests failing together)
    assert (inst.failures, inst.healthy, inst.backing_off, inst.out) == (1, False, True, False)
    assert not inst.retry_due(0.4) and inst.retry_due(0.5)
    for now in (0.5, 1.5, 3.5):
        inst.mark_down("refused", now=now)
    assert inst.failures == 4 and inst.out and not inst.retry_due(100.0)
    inst.mark_up()
    assert inst.healthy and inst.failures == 0 and inst.problem is None


def test_a_backing_off_instance_is_skipped_while_another_is_healthy():
    a, b = Instance("http://a", Role.DECODE, POLICY), Instance("http://b", Role.DECODE, POLICY)
    a.mark_down("refused")
    assert {choose([a, b], turn=t).instance.url for t in range(4)} == {"http://b"}


def _forwarder(*instances: Instance) -> Forwarder:
    config = RouterConfig(prefill=tuple(i.url for i in instances if i.role == Role.PREFILL),
                          decode=tuple(i.url for i in instances if i.role == Role.DECODE),
                          max_failures=POLICY.max_failures, retry_backoff_s=POLICY.backoff_s)
    pool = InstancePool(list(instances), 1.0, 1.0)
    return Forwarder(config, pool, RouterMetrics(pool), None, None)  # type: ignore[arg-type]


def _failing(times: int) -> tuple[list[float], object]:
    """An attempt that cannot connect ``times`` times, then answers; and when it was called."""
    calls: list[float] = []

    async def attempt(inst: Instance) -> str:
        calls.append(time.monotonic())
        if len(calls) <= times:
            raise UpstreamFailure("ConnectError: refused", down=True)
        return "answer"
    return calls, attempt


def test_the_only_decode_instance_is_retried_with_backoff_until_it_answers():
    decode = Instance("http://d", Role.DECODE, POLICY)
    fwd = _forwarder(Instance("http://p", Role.PREFILL, POLICY), decode)
    calls, attempt = _failing(POLICY.max_failures - 1)
    inst, result = asyncio.run(fwd._attempts(Role.DECODE, Job("/v1/completions", {}, {}), attempt))
    assert inst is decode and result == "answer" and decode.healthy  # its answer cleared the failures
    gaps = [b - a for a, b in zip(calls, calls[1:], strict=False)]
    for gap, backoff in zip(gaps, [0.05, 0.1, 0.2], strict=True):  # the back-off, doubled each time
        assert backoff - 0.01 <= gap < backoff + 0.5


def test_a_dead_decode_instance_is_given_up_after_max_failures_and_named():
    decode = Instance("http://d", Role.DECODE, POLICY)
    fwd = _forwarder(Instance("http://p", Role.PREFILL, POLICY), decode)
    calls, attempt = _failing(100)
    with pytest.raises(Relay) as e:
        asyncio.run(fwd._attempts(Role.DECODE, Job("/v1/completions", {}, {}), attempt))
    assert e.value.status == 503 and len(calls) == POLICY.max_failures and decode.out
    assert b"http://d is out of rotation after 4 consecutive failures" in e.value.content
    calls, attempt = _failing(100)
    with pytest.raises(Relay):  # out: refused at once, not tried
        asyncio.run(fwd._attempts(Role.DECODE, Job("/v1/completions", {}, {}), attempt))
    assert calls == []


def test_prefill_does_not_wait_for_its_instance():
    """A backing-off prefill instance is not waited for: the decode instance computes the prompt."""
    prefill = Instance("http://p", Role.PREFILL, POLICY)
    fwd = _forwarder(prefill, Instance("http://d", Role.DECODE, POLICY))
    calls, attempt = _failing(100)
    with pytest.raises(Relay) as e:
        asyncio.run(fwd._attempts(Role.PREFILL, Job("/v1/completions", {}, {}), attempt))
    assert e.value.status == 503 and len(calls) == 1 and prefill.backing_off
