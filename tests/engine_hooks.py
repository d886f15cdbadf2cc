"""Slow or failing engine steps on demand (StepControl), the picklable factory that builds such
an engine inside an engine-core process, and `serve_main` for servers run as subprocesses.

Kept apart from server_harness, and importing neither torch nor the engine at module level:
a `treadle serve` API process started by serve_main stays torch-free, as the real one is
(importing server_harness there cost ~3 s of torch and engine imports per server start), and
an engine process that unpickles the factory imports the engine, not uvicorn, httpx and the
app. The engine classes come from hooked_engine.py, which only the engine's side imports."""
from __future__ import annotations

import multiprocessing
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from treadle.engine.llm_engine import LLMEngine


class InjectedStepFault(RuntimeError):
    """Raised inside a step by ``StepControl.fail_next_step``."""


class StepControl:
    """Slow or failing engine steps, set by a test while the engine runs, in a thread
    of the test process or in an engine-core process (the values live in shared memory
    handed to the spawned process)."""

    def __init__(self, step_delay: float = 0.0) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._delay = ctx.Value("d", step_delay, lock=False)
        self._fail = ctx.Value("i", 0, lock=False)
        self._fail_execute = ctx.Value("i", 0, lock=False)

    def set_step_delay(self, seconds: float) -> None:
        """Sleep this long before every step (a slow or stuck engine)."""
        self._delay.value = seconds

    def fail_next_step(self) -> None:
        """The next step raises around the engine (as a broken loop would): the engine dies."""
        self._fail.value = 1

    def fail_next_execute(self) -> None:
        """The model raises in the next step, as a model error on some input would: the
        engine fails that step's requests (StepFailedError) and goes on."""
        self._fail_execute.value = 1

    def before_execute(self) -> None:
        if self._fail_execute.value:
            self._fail_execute.value = 0
            raise InjectedStepFault("model failure injected by the test")

    def before_step(self) -> None:
        if self._delay.value > 0:
            time.sleep(self._delay.value)
        if self._fail.value:
            self._fail.value = 0
            raise InjectedStepFault("step failure injected by the test")


class HookedExecutor:
    """The engine's real executor, with a StepControl consulted before each model run."""

    def __init__(self, inner: Any, control: StepControl) -> None:
        self._inner, self._control = inner, control

    def execute(self, sched: Any) -> Any:
        self._control.before_execute()
        return self._inner.execute(sched)

    def submit(self, sched: Any) -> None:  # the engine's step (the batch queue's half of execute)
        self._control.before_execute()
        self._inner.submit(sched)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class HookedEngineFactory:
    """``(model, **engine_kwargs) -> HookedEngine``; picklable, so it can build the engine
    inside an engine-core process (the `engine_factory` of serve.start_engine)."""

    def __init__(self, control: StepControl) -> None:
        self.control = control

    def __call__(self, model: str, **kwargs: Any) -> LLMEngine:
        from hooked_engine import HookedEngine  # the engine (and torch): only where it runs

        engine = HookedEngine.from_args(model, **kwargs)
        engine.control = self.control
        engine.executor = HookedExecutor(engine.executor, self.control)
        return engine


def serve_main() -> None:
    """`treadle serve` whose engine sleeps before every step, for tests that run the server
    as a subprocess: ``python -c 'import engine_hooks as h; h.serve_main()' DELAY serve ...``."""
    from treadle.entrypoints.cli import build_parser
    from treadle.entrypoints.serve import run_serve

    delay, *argv = sys.argv[1:]
    args = build_parser().parse_args(argv)
    raise SystemExit(run_serve(args, HookedEngineFactory(StepControl(float(delay)))))
