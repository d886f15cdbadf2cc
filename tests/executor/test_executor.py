"""Executors with real worker processes: the mp executor is token-identical to the in-process
one, a lost worker is a clear EngineDeadError and an unhealthy engine within seconds, and no
worker outlives its engine."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_harness import ENGINE_KW, MODEL_NAME, ServerThread, wait_until

from treadle import LLM, SamplingParams
from treadle.config import EngineDeadError, ParallelConfig, TreadleError
from treadle.core.step_data import ModelRunnerOutput, NewRequestData, ScheduledRequest, SchedulerOutput, TokenLogprobs
from treadle.engine.args import engine_args
from treadle.engine.client.in_process import AsyncLLM
from treadle.engine.resolver import create_engine_config
from treadle.executor.messages import Codec
from treadle.executor.multiproc import MultiprocExecutor
from treadle.loaders.resolve import resolve_model
from treadle.server.app import build_app

pytestmark = [pytest.mark.server, pytest.mark.usefixtures("one_thread")]

KW = dict(num_kv_blocks=128, block_size=16, max_num_batched_tokens=48)  # chunked prompts, several steps
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=77, max_tokens=12, ignore_eos=True, logprobs=2)
PROMPTS = ["Once upon a time", "The little dog ran to the", "Lily and Tom went to the park. They saw a big tree",
           {"prompt_token_ids": [1, 40, 30, 200, 17, 90, 3, 55, 88, 120] * 7}]


@pytest.fixture(autouse=True)
def short_step_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hung worker fails a test in a minute, not in the default five."""
    monkeypatch.setenv("TREADLE_EXECUTE_TIMEOUT_S", "60")
    monkeypatch.setenv("TREADLE_WORKER_START_TIMEOUT_S", "120")


def gone(pid: int) -> bool:
    """The process has exited (reaped, or a zombie waiting for a parent that is not ours)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def worker_pid(llm: AsyncLLM) -> int:
    """The pid of the one worker process of an engine started with the "mp" executor."""
    (pid,) = llm._core.engine.executor.worker_pids
    return pid


@pytest.fixture
def mp_llm() -> Iterator[LLM]:
    llm = LLM("stories260k", distributed_executor_backend="mp", **KW)
    try:
        yield llm
    finally:
        pids = llm.engine.executor.worker_pids
        llm.shutdown()
        assert all(gone(pid) for pid in pids)


def outputs(llm: LLM, params: SamplingParams) -> list:
    return [(o.prompt_logprobs, [(c.token_ids, c.logprobs) for c in o.outputs])
            for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_mp_executor_is_token_identical_to_uni(mp_llm: LLM, tiny_llama: Path) -> None:
    uni = LLM("stories260k", **KW)
    for params in (GREEDY, SEEDED, dataclasses.replace(SEEDED, n=2, seed=5)):
        expected = outputs(uni, params)
        assert outputs(mp_llm, params) == expected  # tokens and logprobs, exactly
        assert any(lp for _, comps in expected for _, lp in comps)
    tiny_kw = dict(KW, max_num_batched_tokens=16)
    tiny_uni = LLM(str(tiny_llama), **tiny_kw)
    tiny_mp = LLM(str(tiny_llama), distributed_executor_backend="mp", **tiny_kw)
    try:
        assert outputs(tiny_mp, SEEDED) == outputs(tiny_uni, SEEDED)
    finally:
        tiny_mp.shutdown()
    kv = mp_llm.engine.kv_manager
    assert kv.num_free_blocks == kv.pool.num_blocks and mp_llm.engine.health() is None


def test_killed_worker_is_a_clear_error_and_an_unhealthy_engine(mp_llm: LLM) -> None:
    engine = mp_llm.engine
    engine.add_request("a", "Once upon a time", SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    engine.step()
    pid = engine.executor.worker_pids[0]
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match="killed by SIGKILL") as info:
        for _ in range(1000):
            engine.step()
    assert time.monotonic() - t0 < 5.0
    assert "\n" not in str(info.value)
    assert "SIGKILL" in (engine.health() or "")
    with pytest.raises(EngineDeadError):  # stays dead
        engine.step()
    assert gone(pid)


def test_hung_worker_is_a_clear_error_after_the_step_timeout(mp_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREADLE_EXECUTE_TIMEOUT_S", "2")
    engine = mp_llm.engine
    engine.add_request("a", "Once upon a time", SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    pid = engine.executor.worker_pids[0]
    os.kill(pid, signal.SIGSTOP)  # alive, but answers nothing
    t0 = time.monotonic()
    try:
        with pytest.raises(EngineDeadError, match="did not finish a step within 2 s"):
            engine.step()
        assert time.monotonic() - t0 < 10.0
        assert engine.health() is not None
    finally:
        if not gone(pid):
            os.kill(pid, signal.SIGCONT)


def test_failed_step_on_a_worker_raises_and_the_executor_goes_on() -> None:
    config, _ = create_engine_config(engine_args("stories260k", num_kv_blocks=8, distributed_executor_backend="mp"))
    executor = MultiprocExecutor(config)
    try:
        unknown = SchedulerOutput([], [ScheduledRequest("never-sent", [0], 0, 1)], [])
        with pytest.raises(RuntimeError, match="worker rank 0: KeyError"):
            executor.execute(unknown)
        assert executor.health() is None
        prompt = [1, 400, 30, 200]
        new = NewRequestData("r", prompt, SamplingParams(temperature=0.0, max_tokens=2), (2,))
        out = executor.execute(SchedulerOutput([new], [ScheduledRequest("r", [0], 0, len(prompt))], []))
        assert set(out.sampled) == {"r"}
    finally:
        executor.shutdown()


def test_step_frames_round_trip() -> None:
    codec = Codec()
    params = SamplingParams(n=2, temperature=0.7, stop="x", stop_token_ids=[5], seed=3, logprobs=2, max_tokens=9)
    sched = SchedulerOutput([NewRequestData("a", [1, 2, 3], params, (2, 1), seed_offset=1)],
                            [ScheduledRequest("a", [4, 5], 16, 3, [8, 9])], ["gone"], num_preemptions=2)
    assert codec.decode_step(codec.encode(sched)) == sched
    out = ModelRunnerOutput({"a": [7, 8]}, {"a": [TokenLogprobs(7, -0.1234567890123, 1, [(7, -0.1234567890123)])]},
                            {"a": (1, [TokenLogprobs(2, -3.5, 4, [(9, -0.5)])])}, {"a": [3, 4]})
    assert codec.decode_output(codec.encode(out)) == out  # float64: logprobs unchanged


def test_mp_worker_load_error_is_one_line(tmp_path: Path) -> None:
    config, _ = create_engine_config(engine_args("stories260k", num_kv_blocks=8, distributed_executor_backend="mp"))
    moved = dataclasses.replace(config, load=dataclasses.replace(config.load, model_path=str(tmp_path / "gone")))
    with pytest.raises(TreadleError, match="no such file or directory") as info:
        MultiprocExecutor(moved)
    assert "\n" not in str(info.value)


def test_two_ranks_share_each_step() -> None:
    """World size 2 (both ranks hold the whole model until tensor parallelism lands): the step
    reaches both ranks, they rendezvous in one gloo group, the output comes from the last."""
    config, _ = create_engine_config(engine_args("stories260k", num_kv_blocks=8, distributed_executor_backend="mp"))
    two = dataclasses.replace(config, parallel=ParallelConfig("mp", 2, 1, False))
    executor = MultiprocExecutor(two)
    try:
        prompt = [1, 400, 30, 200]
        new = NewRequestData("r", prompt, SamplingParams(temperature=0.0, max_tokens=2), (2,))
        out = executor.execute(SchedulerOutput([new], [ScheduledRequest("r", [0], 0, len(prompt))], []))
        out2 = executor.execute(SchedulerOutput([], [ScheduledRequest("r", [0], len(prompt), 1)], []))
        assert set(out.sampled) == {"r"} and set(out2.sampled) == {"r"}
        assert executor.kv_capacity() == (8, 16) and executor.health() is None
    finally:
        pids = executor.worker_pids
        executor.shutdown()
    assert len(pids) == 2 and all(gone(pid) for pid in pids)


def test_async_engine_and_health_endpoint_see_a_lost_worker() -> None:
    llm = AsyncLLM.from_args(str(resolve_model("stories260k")), distributed_executor_backend="mp", **ENGINE_KW)
    try:
        pid = worker_pid(llm)
        with ServerThread(build_app(llm, MODEL_NAME)) as srv:
            assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200

            async def stream_then_kill() -> None:
                params = SamplingParams(max_tokens=400, ignore_eos=True)
                async for out in llm.generate("Once upon a time", params, "victim"):
                    if len(out.outputs[0].token_ids) == 2:
                        os.kill(pid, signal.SIGKILL)

            with pytest.raises(EngineDeadError, match="SIGKILL"):
                asyncio.run(asyncio.wait_for(stream_then_kill(), 30))
            r = wait_until(lambda: (r := httpx.get(f"{srv.url}/health", timeout=10)).status_code == 503 and r,
                           10, "/health to report the dead worker")
            assert "SIGKILL" in r.text
    finally:
        llm.shutdown()
    assert gone(pid)


def test_idle_engine_reports_a_lost_worker() -> None:
    llm = AsyncLLM.from_args(str(resolve_model("stories260k")), distributed_executor_backend="mp", **ENGINE_KW)
    try:
        pid = worker_pid(llm)
        assert llm.health() is None
        os.kill(pid, signal.SIGKILL)
        reason = wait_until(llm.health, 5, "health to notice the lost worker")
        assert "SIGKILL" in reason
    finally:
        llm.shutdown()
    assert gone(pid)


ORPHAN_SCRIPT = """
import os, sys, torch
from treadle import LLM
if __name__ == "__main__":
    torch.set_num_threads(1)
    llm = LLM("stories260k", num_kv_blocks=8, distributed_executor_backend="mp")
    print(llm.engine.executor.worker_pids[0], flush=True)
    os.kill(os.getpid(), 9)  # the engine process dies without shutting anything down
"""


def test_worker_of_a_killed_engine_exits_on_its_own(tmp_path: Path) -> None:
    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    pid = int(proc.stdout.split()[0])
    try:
        wait_until(lambda: gone(pid), 10, "the orphaned worker to exit")
    finally:
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)
