"""What the engine counts: each step's wall time by part, and the totals the metrics endpoint,
`LLM.get_stats()` and the benchmarks read."""
from __future__ import annotations

from typing import Any, NamedTuple

from treadle.core.request import Request
from treadle.core.spec_metrics import SpecDecodeStats
from treadle.core.step_data import SchedulerOutput


class StepSeconds(NamedTuple):
    """Where the last step's wall time went (``treadle bench ab`` reads it). Under pipeline
    stages ``schedule`` and ``model`` overlap other steps' and are only indicative."""

    schedule: float  # choosing the step (and, with steps in flight, submitting earlier ones)
    model: float  # submit to collect: the workers' step (inputs, model, sampling)
    update: float  # the scheduler taking the results
    output: float  # detokenization, stop strings, RequestOutputs


class EngineStats:
    """Counters the metrics endpoint and benchmarks read (``spec_decode``: speculation's
    counters, None when speculation is off)."""

    def __init__(self, spec_decode: SpecDecodeStats | None = None) -> None:
        self.spec_decode = spec_decode
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_tokens_computed = 0  # tokens run through the model (prompt, recompute, decode)
        self.num_generated_tokens = 0
        self.max_steps_in_flight = 0  # the batch queue's high-water mark (1 without pipeline stages)
        self.last_step: StepSeconds | None = None

    def record(self, sched: SchedulerOutput, touched: list[Request]) -> None:
        self.num_steps += 1
        self.num_preemptions += sched.num_preemptions
        self.num_generated_tokens += sum(r.num_new_tokens for r in touched)
        self.num_tokens_computed += sched.total_num_scheduled_tokens

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"steps": self.num_steps, "preemptions": self.num_preemptions,
                               "tokens_computed": self.num_tokens_computed,
                               "generated_tokens": self.num_generated_tokens,
                               "max_steps_in_flight": self.max_steps_in_flight}
        if self.spec_decode is not None:
            out["spec_decode"] = self.spec_decode.as_dict()
        return out
