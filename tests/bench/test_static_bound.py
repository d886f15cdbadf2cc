"""benchmarks/static_bound.py's arithmetic: the static peer's and the continuous run's decode time
under a step cost, on hand-checked lengths."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "static_bound.py"
_spec = importlib.util.spec_from_file_location("static_bound", SCRIPT)
assert _spec is not None and _spec.loader is not None
static_bound = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(static_bound)


def test_step_cost_interpolates_between_measured_batches() -> None:
    cost = static_bound.step_cost([(4, 1.3), (16, 2.5)])
    assert cost[0] == 0.0 and cost[1] == 1.0 and cost[4] == pytest.approx(1.3)
    assert cost[10] == pytest.approx(1.9) and cost[16] == pytest.approx(2.5) and len(cost) == 17


def test_flat_step_favours_continuous_and_a_per_row_cost_does_not() -> None:
    # [4, 1] then [4] in static batches of 2: 4 + 4 steps; continuously the third request
    # takes the finished one's slot after one step: 1 + 4 steps
    flat = static_bound.step_cost([(2, 1.0)])
    assert static_bound.times([4, 1, 4], 2, flat) == (8.0, 5.0)
    # a step costing its rows: both runs pay once per token, whatever the admission
    linear = static_bound.step_cost([(2, 2.0)])
    assert static_bound.times([4, 1, 4], 2, linear) == (9.0, 9.0)
