"""The router balancing by predicted remaining tokens (issue 33), on hand-built instance states."""
from __future__ import annotations

from treadle.router.config import Role
from treadle.router.instances import Instance, InstanceLoad
from treadle.router.policy import REQUEST_COST, choose, cost_score


def _inst(url: str, **load: float) -> Instance:
    inst = Instance(url, Role.BACKEND)
    inst.load = InstanceLoad(**load)  # type: ignore[arg-type]
    return inst


def test_cost_balance_prefers_fewer_predicted_tokens_over_fewer_requests():
    """a runs one long generation, b three one-word answers: by count b looks busier; by
    predicted remaining tokens a is."""
    a = _inst("a", running=1, predicted_remaining_tokens=900)
    b = _inst("b", running=3, predicted_remaining_tokens=6)
    assert choose([a, b], turn=0, by_cost=False).instance is a
    assert choose([a, b], turn=0, by_cost=True).instance is b


def test_requests_sent_since_the_last_report_count_at_the_mean_cost():
    a = _inst("a", running=2, predicted_remaining_tokens=200)  # 100 a request
    b = _inst("b", running=1, predicted_remaining_tokens=250)
    assert choose([a, b], turn=0, by_cost=True).instance is a
    a.in_flight = 3  # one more than it has reported: 300 predicted in all
    assert choose([a, b], turn=0, by_cost=True).instance is b
    idle = _inst("c", predicted_remaining_tokens=0)
    idle.in_flight = 1  # sent, not yet reported, nothing known: REQUEST_COST
    assert cost_score(idle) == 1.0
    assert cost_score(_inst("d", waiting_prompt_tokens=1280, predicted_remaining_tokens=0)) == 128 / REQUEST_COST


def test_instances_without_a_predictor_are_balanced_by_count():
    a, b = _inst("a", running=1), _inst("b", running=3)
    assert cost_score(a) is None
    assert choose([a, b], turn=0, by_cost=True).instance is a
    assert InstanceLoad.from_json({"running": 1, "predicted_remaining_tokens": 42}).predicted_remaining_tokens == 42
    assert InstanceLoad.from_json({"running": 1}).predicted_remaining_tokens is None
