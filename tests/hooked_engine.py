"""The real engine with a StepControl consulted before each step (engine_hooks.py builds it,
in the process that runs the engine)."""
from __future__ import annotations

from engine_hooks import StepControl

from treadle.engine.llm_engine import LLMEngine


class HookedEngine(LLMEngine):
    """The real engine, with a StepControl consulted before each step."""

    control: StepControl

    def step(self):
        self.control.before_step()
        return super().step()
