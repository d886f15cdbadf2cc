"""`treadle bench ab`: two configurations of one engine in one process, their decode steps
interleaved so that both see the same machine load, step by step.

    treadle bench ab --model smollm2-135m-instruct --b '{"kv_cache_dtype": "int8"}' --batch 1 16
    treadle bench ab --a-env TREADLE_ACTIVATION_BITS=16 --b-env TREADLE_ACTIVATION_BITS=8 --batch 1 4 16

Each side is the command's engine flags with its own overrides (``--a`` / ``--b``: JSON of
engine arguments) and environment (``--a-env`` / ``--b-env``: ``NAME=VALUE``, set while that
side is built and while it steps). For every batch size both engines prefill the same
``--batch`` prompts of ``--prompt-len`` token ids, then take ``--steps`` decode steps in turn,
A then B. The table gives the median step (wall) with where it went (the engine's
``stats.last_step``: schedule, model, update, output) and B's speedup over A.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from treadle.config import TreadleError
from treadle.engine.llm_engine import LLMEngine
from treadle.engine.stats import StepSeconds
from treadle.sampling_params import SamplingParams


@dataclass(frozen=True)
class Side:
    name: str
    overrides: dict[str, Any] = field(default_factory=dict)  # engine arguments over the command's
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, name: str, overrides: str | None, env: list[str]) -> Side:
        try:
            kw = json.loads(overrides) if overrides else {}
        except json.JSONDecodeError as e:
            raise TreadleError(f"--{name.lower()}: not JSON ({e.msg})") from None
        if not isinstance(kw, dict):
            raise TreadleError(f"--{name.lower()}: a JSON object of engine arguments, e.g. '{{\"kv_cache_dtype\": \"int8\"}}'")
        bad = [e for e in env if "=" not in e]
        if bad:
            raise TreadleError(f"--{name.lower()}-env takes NAME=VALUE, not {bad[0]!r}")
        return cls(name, kw, dict(e.split("=", 1) for e in env))


@contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` set for the block, the previous values put back after it."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def prompt_ids(i: int, length: int, vocab: int) -> list[int]:
    """Prompt ``i``: ``length`` token ids spread over the vocabulary (no special ids at the ends)."""
    return [5 + (17 * i + 31 * j) % (vocab - 10) for j in range(length)]


def prefill(engine: LLMEngine) -> None:
    """Step ``engine`` until every request's prompt is computed."""
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()


def build(side: Side, base: dict[str, Any], batch: int, prompt_len: int, steps: int) -> LLMEngine:
    with environment(side.env):
        engine = LLMEngine.from_args(**{**base, **side.overrides})
        params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
        for i in range(batch):
            ids = prompt_ids(i, prompt_len, engine.config.model.vocab_size)
            engine.add_request(f"ab-{i}", {"prompt_token_ids": ids}, params)
        prefill(engine)
    return engine


def run_batch(sides: tuple[Side, Side], base: dict[str, Any], batch: int, prompt_len: int,
              steps: int) -> dict[str, dict[str, float]]:
    """Median wall step and its parts (ms) of each side at ``batch``, steps taken in turn."""
    engines = [build(s, base, batch, prompt_len, steps) for s in sides]
    walls: list[list[float]] = [[], []]
    parts: list[list[StepSeconds]] = [[], []]
    try:
        for _ in range(steps):
            for k, (side, engine) in enumerate(zip(sides, engines)):
                with environment(side.env):
                    t = time.perf_counter()
                    engine.step()
                    walls[k].append(time.perf_counter() - t)
                assert engine.stats.last_step is not None
                parts[k].append(engine.stats.last_step)
    finally:
        for engine in engines:
            engine.shutdown()
    out = {}
    for k, side in enumerate(sides):
        row = {"step": statistics.median(walls[k]) * 1e3}
        row |= {name: statistics.median(getattr(p, name) for p in parts[k]) * 1e3 for name in StepSeconds._fields}
        out[side.name] = row
    return out


def table(results: dict[int, dict[str, dict[str, float]]], sides: tuple[Side, Side]) -> str:
    """One row per batch size; with batch 1 among them, each side's step over its batch-1 step too."""
    a, b = (s.name for s in sides)
    one = results.get(1)
    head = f"| batch | {a} step ms | {b} step ms | {b} speedup |"
    head += f" {a} / batch 1 | {b} / batch 1 |" if one else ""
    head += "".join(f" {n} ms ({a} / {b}) |" for n in StepSeconds._fields)
    lines = [head, "|---" * head.count(" |") + "|"]
    for batch, r in results.items():
        row = f"| {batch} | {r[a]['step']:.2f} | {r[b]['step']:.2f} | {r[a]['step'] / r[b]['step']:.3f}x |"
        if one:
            row += f" {r[a]['step'] / one[a]['step']:.2f}x | {r[b]['step'] / one[b]['step']:.2f}x |"
        lines.append(row + "".join(f" {r[a][n]:.2f} / {r[b][n]:.2f} |" for n in StepSeconds._fields))
    return "\n".join(lines)


def run_ab(sides: tuple[Side, Side], base: dict[str, Any], batches: list[int], prompt_len: int,
           steps: int) -> dict[int, dict[str, dict[str, float]]]:
    """Every batch size in turn; prints the table as it grows and returns the figures."""
    for s in sides:
        print(f"{s.name}: {json.dumps(s.overrides) if s.overrides else 'the flags as given'}"
              + (f", env {' '.join(f'{k}={v}' for k, v in s.env.items())}" if s.env else ""))
    results: dict[int, dict[str, dict[str, float]]] = {}
    for batch in batches:
        results[batch] = run_batch(sides, base, batch, prompt_len, steps)
    print(table(results, sides), flush=True)
    return results
