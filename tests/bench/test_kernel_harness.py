"""The kernel micro-benchmarks' harness (benchmarks/kernels/harness.py) on fake cases and a fake
clock: rounds are interleaved, warm-up and ``before`` are untimed, samples are per call, and
medians and ratios come out of them."""
from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "harness.py"
_spec = importlib.util.spec_from_file_location("kernel_harness", HARNESS)
assert _spec is not None and _spec.loader is not None
harness = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = harness  # its dataclasses look their module up
_spec.loader.exec_module(harness)


class FakeClock:
    """Time moves only when a case says so."""

    def __init__(self) -> None:
        self.now = 0.0
        self.calls: list[str] = []

    def __call__(self) -> float:
        return self.now

    def case(self, name: str, costs: list[float]) -> Callable[[], None]:
        """A case's fn: each call costs the next of ``costs``."""
        it = iter(costs)

        def fn() -> None:
            self.calls.append(name)
            self.now += next(it)
        return fn


def test_rounds_interleave_and_warmup_is_untimed():
    clock = FakeClock()
    slow = harness.Case("slow", clock.case("slow", [100.0, 4.0, 2.0, 3.0]))  # the first call: warm-up
    fast = harness.Case("fast", clock.case("fast", [100.0, 1.0, 1.0, 2.0]),
                        before=lambda: setattr(clock, "now", clock.now + 50))  # untimed
    t = harness.interleave([slow, fast], repeats=3, warmup=1, clock=clock)
    assert clock.calls == ["slow", "fast"] * 4
    assert t.samples == {"slow": [4.0, 2.0, 3.0], "fast": [1.0, 1.0, 2.0]}
    assert t.median("slow") == 3.0 and t.best("slow") == 2.0 and t.median("fast") == 1.0
    assert t.ratio("slow", "fast") == 3.0 and t.ratio("fast", "fast") == 1.0
    assert t.names == ["slow", "fast"]


def test_samples_are_per_call_and_names_must_differ():
    clock = FakeClock()
    t = harness.interleave([harness.Case("x10", clock.case("x10", [5.0, 7.0]), calls=10)], 2, 0, clock)
    assert t.samples["x10"] == pytest.approx([0.5, 0.7])
    with pytest.raises(ValueError):
        harness.interleave([harness.Case("a", lambda: None), harness.Case("a", lambda: None)], 1, 0, clock)


def test_options_clock_and_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = harness.parser("doc", repeats=3).parse_args(["--threads", "0", "--json", str(out)])
    assert (args.repeats, args.warmup, args.clock) == (3, 1, "auto")
    assert harness.clock_for("auto", 1).name == "thread CPU" and harness.clock_for("auto", 2).name == "wall"
    run = harness.Run(args, harness.clock_for("wall", 2), {"model": "fake", "features": ["avx2"]})
    run.table(["case", "ms"], [["a", 1.23456]], title="t")
    run.finish()
    assert "| a | 1.235 |" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["machine"]["features"] == ["avx2"] and saved["tables"][0]["rows"] == [["a", 1.23456]]
