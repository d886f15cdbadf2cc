"""The router's dispatch queue (``--queue``, issue 33): requests wait in the router until an
instance has a free batch slot, and go shortest predicted job first with the engine's bounds.
The queue's rules on hand-built instance states; then the real thing: two `treadle serve`
instances with one slot each behind `treadle router --queue predicted`."""
from __future__ import annotations

import asyncio
import concurrent.futures
import time

import httpx
import openai
import pytest
from router_harness import instance, router, router_metric, running
from server_harness import wait_until

from treadle.core.cost_policy import COST_HALF, PREFILL_TOKEN_COST, UNKNOWN_OUTPUT_TOKENS
from treadle.router.config import Role, RouterConfig
from treadle.router.forward import Forwarder
from treadle.router.instances import Instance, InstanceLoad, InstancePool
from treadle.router.metrics import RouterMetrics
from treadle.router.queue import DispatchQueue, Waiter
from treadle.router.upstream import Job


def _pool(*slots: int | None) -> InstancePool:
    insts = []
    for n, s in enumerate(slots):
        inst = Instance(f"http://i{n}", Role.BACKEND)
        inst.load = InstanceLoad(max_num_seqs=s)
        insts.append(inst)
    return InstancePool(insts, 0.5, 1.0)


async def _grant_order(queue: DispatchQueue, costs: list[float], held: int) -> list[int]:
    """Hold ``held`` slots, queue requests of these costs (in this arrival order), then free
    one slot at a time; the order in which the queued requests got their slots."""
    for _ in range(held):
        await queue.acquire(0.0)
    order: list[int] = []

    async def one(i: int, cost: float) -> None:
        await queue.acquire(cost)
        order.append(i)

    tasks = []
    for i, c in enumerate(costs):
        tasks.append(asyncio.create_task(one(i, c)))
        await asyncio.sleep(0)  # each is queued before the next arrives
    assert len(queue.waiting) == len(costs) and not order
    for _ in range(held + len(costs)):
        queue.release()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return order


def test_waits_for_a_free_slot_then_goes_shortest_predicted_first():
    queue = DispatchQueue(_pool(1, 1), "backend", "predicted")
    assert queue.capacity() == 2
    assert asyncio.run(_grant_order(queue, [300.0, 5.0, 90.0, 1.0], held=2)) == [3, 1, 2, 0]


def test_fcfs_goes_in_arrival_order():
    queue = DispatchQueue(_pool(2), "backend", "fcfs")
    assert asyncio.run(_grant_order(queue, [300.0, 5.0, 90.0, 1.0], held=2)) == [0, 1, 2, 3]


def test_count_bound_a_long_request_is_passed_over_at_most_max_passed_over_times():
    queue = DispatchQueue(_pool(1), "backend", "predicted", max_passed_over=3)
    order = asyncio.run(_grant_order(queue, [1000.0] + [1.0] * 6, held=1))
    assert order == [1, 2, 3, 0, 4, 5, 6]  # three later arrivals overtook it, the fourth did not


def test_aging_bound_no_request_passed_over_by_one_arriving_aging_s_later():
    """The key is aged_start(arrival, cost, aging_s) < arrival + aging_s, whatever the cost."""
    queue = DispatchQueue(_pool(1), "backend", "predicted", aging_s=10.0)

    async def keys() -> list[tuple[float, ...]]:
        old = Waiter(100.0, 1e9, 0)
        late = Waiter(110.0, 0.0, 1)  # arrived aging_s later, predicted to cost nothing
        return [queue.key(old), queue.key(late), queue.key(Waiter(100.0, COST_HALF, 2))]

    old, late, half = asyncio.run(keys())
    assert old < late
    assert half[1] == 105.0  # half of aging_s at COST_HALF


def test_no_queue_while_an_instance_reports_no_slots_or_all_are_out():
    assert DispatchQueue(_pool(4, None), "backend", "predicted").capacity() is None
    pool = _pool(1, 1)
    for inst in pool.instances:
        inst.failures = inst.policy.max_failures
    queue = DispatchQueue(pool, "backend", "predicted")
    assert queue.capacity() is None

    async def go() -> None:  # nothing blocks: the forwarder's 503 rules answer
        for _ in range(5):
            await asyncio.wait_for(queue.acquire(1.0), 1.0)

    asyncio.run(go())


def test_a_client_leaving_while_queued_or_just_granted_frees_its_place():
    async def go() -> None:
        queue = DispatchQueue(_pool(1), "backend", "predicted")
        await queue.acquire(0.0)  # the one slot
        leaving = asyncio.create_task(queue.acquire(1.0))
        staying = asyncio.create_task(queue.acquire(50.0))
        await asyncio.sleep(0)
        leaving.cancel()
        await asyncio.sleep(0)
        queue.release()
        await asyncio.wait_for(staying, 1.0)  # the cancelled waiter did not take the slot
        assert queue.active == 1 and not queue.waiting
        late = asyncio.create_task(queue.acquire(1.0))
        await asyncio.sleep(0)
        queue.release()  # granted ...
        late.cancel()  # ... but cancelled before it resumed: the slot comes back
        with pytest.raises(asyncio.CancelledError):
            await late
        assert queue.active == 0

    asyncio.run(go())


def test_config_refuses_unknown_queue_orders():
    with pytest.raises(ValueError, match="--queue"):
        RouterConfig(backend=("http://a",), queue="sjf")
    assert InstanceLoad.from_json({"max_num_seqs": 4}).max_num_seqs == 4
    assert InstanceLoad.from_json({}).max_num_seqs is None


def test_the_count_bound_defaults_to_20_per_generating_instance():
    """Two instances admit twice as often as one: 40 passes take about as long as one engine's 20."""
    config = RouterConfig(backend=("http://a", "http://b"), queue="predicted")
    pool = InstancePool([Instance(u, Role.BACKEND) for u in config.backend], 0.5, 1.0)
    forwarder = Forwarder(config, pool, RouterMetrics(pool), None, None)  # type: ignore[arg-type]
    assert forwarder.queue is not None and forwarder.queue.max_passed_over == 40
    config = RouterConfig(backend=("http://a", "http://b"), queue="predicted", queue_max_passed_over=7)
    assert Forwarder(config, pool, RouterMetrics(pool), None, None).queue.max_passed_over == 7  # type: ignore[arg-type,union-attr]


def test_a_request_that_cannot_stop_early_costs_its_max_tokens_in_the_queue():
    """As in the engine: EOS ignored with no stop strings or ids runs to max_tokens, so that is its
    output cost, not the (shorter) guess; one that may stop keeps the guess, capped at max_tokens.
    Token-id prompts ask no instance (/tokenize takes text): the prompt counts its ids."""
    config = RouterConfig(backend=("http://a",), queue="predicted")
    pool = InstancePool([Instance(u, Role.BACKEND) for u in config.backend], 0.5, 1.0)
    forwarder = Forwarder(config, pool, RouterMetrics(pool), None, None)  # type: ignore[arg-type]

    def cost(**extra: object) -> float:
        job = Job("/v1/completions", {"prompt": [1, 2, 3, 4], "max_tokens": 400, **extra}, {})
        return asyncio.run(forwarder.predicted_cost(job)) - PREFILL_TOKEN_COST * job.prompt_tokens

    assert cost(ignore_eos=True) == 400
    assert cost(ignore_eos=True, n=2) == 2 * 400 + PREFILL_TOKEN_COST * 4
    assert cost() == UNKNOWN_OUTPUT_TOKENS < 400
    assert cost(ignore_eos=True, stop=["."]) == cost(ignore_eos=True, stop_token_ids=[7]) == UNKNOWN_OUTPUT_TOKENS
    assert cost(ignore_eos=True, max_tokens=5) == 5


# --- two real instances behind `treadle router --queue predicted` -------------------------------

STEP_DELAY = 0.01  # each engine step sleeps this long, so requests stay in flight


@pytest.fixture(scope="module")
def queued_pool(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router_queue")
    a = instance(tmp, "a", STEP_DELAY, "stories260k", "--max-num-seqs", "1")
    b = instance(tmp, "b", STEP_DELAY, "stories260k", "--max-num-seqs", "1")
    r = router(tmp, "router", "--backend", a.url, b.url, "--poll-interval", "0.2", "--queue", "predicted")
    with running(a, b):
        with running(r):
            yield a, b, r


def _complete(url: str, max_tokens: int, stamps: dict[int, float] | None = None, key: int = 0) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    text = client.completions.create(model="stories260k", prompt="Once upon a time", max_tokens=max_tokens,
                                     temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    if stamps is not None:
        stamps[key] = time.monotonic()
    return text


@pytest.mark.server
@pytest.mark.slow
def test_queued_requests_wait_in_the_router_and_the_shortest_goes_first(queued_pool):
    """Both slots are held by streams; four requests queue in the router (the long ones first);
    once the slots free, the two short ones run before either long one, and every answer equals
    the instance's own."""
    a, b, r = queued_pool
    assert httpx.get(a.url + "/load").json()["max_num_seqs"] == 1
    tok = httpx.post(a.url + "/tokenize", json={"prompt": "Once upon a time"}).json()
    assert tok["predicted_output_tokens"] >= 3  # stories260k's shipped predictor: longer than the short ones
    expected = {n: _complete(a.url, n) for n in (2, 40)}
    wait_until(lambda: router_metric(r.url, "treadle:router_instance_healthy") == 2, 10, "the router to poll both")
    hold = {"model": "stories260k", "prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}
    stamps: dict[int, float] = {}
    with httpx.stream("POST", r.url + "/v1/completions", json=hold, timeout=60) as s1, \
            httpx.stream("POST", r.url + "/v1/completions", json=hold, timeout=60) as s2:
        held = [s.iter_lines() for s in (s1, s2)]
        assert all(next(lines).startswith("data: {") for lines in held)  # both slots taken
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            futures = {}
            for key, n in enumerate((40, 40, 2, 2)):  # the long ones arrive first
                futures[key] = ex.submit(_complete, r.url, n, stamps, key)
                wait_until(lambda k=key: router_metric(r.url, "treadle:router_queue_waiting") == k + 1, 10,
                           f"request {key} to queue in the router")
            for s in (s1, s2):
                s.close()
            got = {k: f.result(timeout=120) for k, f in futures.items()}
    assert got == {0: expected[40], 1: expected[40], 2: expected[2], 3: expected[2]}
    assert max(stamps[2], stamps[3]) < min(stamps[0], stamps[1]), stamps
    assert router_metric(r.url, "treadle:router_queue_waiting") == 0
    assert router_metric(r.url, "treadle:router_queue_wait_seconds_count") >= 6
