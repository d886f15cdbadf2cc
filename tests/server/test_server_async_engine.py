"""The engine clients on their own (AsyncLLM's thread and the engine-core process, one
contract): per-request streams, abort, refused requests, shutdown, a killed engine."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest
from server_harness import ENGINE_KW, StepControl, engine, start_engine, wait_until

from treadle import LLM, SamplingParams
from treadle.config import EngineDeadError, TreadleError
from treadle.engine.client.engine_client import EngineClient
from treadle.engine.client.multi_process import EngineCoreClient
from treadle.loaders.resolve import resolve_model

pytestmark = pytest.mark.server  # starts processes (servers, workers)

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
MODES = pytest.mark.parametrize("in_process", [False, True], ids=["engine-process", "engine-thread"])


@pytest.fixture(scope="module", params=[False, True], ids=["engine-process", "engine-thread"])
def llm(request):
    with engine(resolve_model("stories260k"), in_process=request.param) as client:
        yield client


def idle(llm: EngineClient) -> bool:
    s = llm.snapshot
    return s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_blocks


async def _collect(llm: EngineClient, prompt, params: SamplingParams, rid: str) -> list:
    return [out async for out in llm.generate(prompt, params, rid)]


def test_concurrent_generate_matches_offline(llm):
    prompts = ["Once upon a time", "The cat", [1, 400, 300]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)

    async def run():
        return await asyncio.gather(*[_collect(llm, p, params, f"r{i}") for i, p in enumerate(prompts)])

    streams = asyncio.run(run())
    ref = LLM(str(resolve_model("stories260k")), **ENGINE_KW).generate(prompts, params, use_tqdm=False)
    for outs, expected in zip(streams, ref):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert "".join(o.outputs[0].new_text for o in outs) == expected.outputs[0].text
        final, want = outs[-1].outputs[0], expected.outputs[0]
        assert final.token_ids == want.token_ids and final.text == want.text
        assert outs[-1].prompt_token_ids == expected.prompt_token_ids and outs[-1].prompt == expected.prompt
        assert [sorted(e) for e in final.logprobs] == [sorted(e) for e in want.logprobs]
        assert [e[t].logprob for e, t in zip(final.logprobs, final.token_ids)] == pytest.approx(
            [e[t].logprob for e, t in zip(want.logprobs, want.token_ids)], abs=1e-5)
    assert llm.num_open_requests == 0 and llm.health() is None


def test_prompt_logprobs_and_stop_strings_cross_the_boundary(llm):
    params = SamplingParams(temperature=0.0, max_tokens=30, prompt_logprobs=1, stop=["Lily"])
    outs = asyncio.run(_collect(llm, "Once upon a time", params, "pl"))
    [ref] = LLM(str(resolve_model("stories260k")), **ENGINE_KW).generate(["Once upon a time"], params,
                                                                          use_tqdm=False)
    assert outs[-1].outputs[0].text == ref.outputs[0].text and outs[-1].outputs[0].stop_reason == "Lily"
    assert len(outs[-1].prompt_logprobs) == len(ref.prompt_logprobs) == len(ref.prompt_token_ids)
    assert [sorted(e) if e else e for e in outs[-1].prompt_logprobs] == \
        [sorted(e) if e else e for e in ref.prompt_logprobs]


def test_leaving_the_stream_aborts_and_frees_blocks(llm):
    async def run():
        async for out in llm.generate("Once upon a time", SamplingParams(max_tokens=400, ignore_eos=True), "leave"):
            if len(out.outputs[0].token_ids) >= 2:
                break

    asyncio.run(run())
    wait_until(lambda: idle(llm), 10, "the abort to free the request's blocks")
    assert llm.num_open_requests == 0


def test_inadmissible_request_raises_and_loop_survives(llm):
    with pytest.raises(TreadleError, match="max_model_len"):
        asyncio.run(_collect(llm, "word " * 600, PARAMS, "long"))
    # a prompt the engine cannot read is refused alone, by name; the loop keeps running
    with pytest.raises(TreadleError, match="needs 'prompt' or 'prompt_token_ids'"):
        asyncio.run(_collect(llm, {"not_a_prompt": 1}, PARAMS, "odd"))
    assert llm.health() is None
    assert asyncio.run(_collect(llm, "Once", PARAMS, "after"))[-1].finished


@MODES
def test_shutdown_fails_open_requests_instead_of_hanging(in_process):
    control = StepControl(step_delay=0.05)
    llm = start_engine(resolve_model("stories260k"), control=control, in_process=in_process)

    async def run():
        outs = []
        with pytest.raises(EngineDeadError):
            async for out in llm.generate("Once", SamplingParams(max_tokens=300, ignore_eos=True), "x"):
                outs.append(out)
                if len(outs) == 2:
                    await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
        return outs

    try:
        assert len(asyncio.run(run())) >= 2
    finally:
        llm.shutdown()
    assert llm.health() is not None and not llm.is_alive()
    with pytest.raises(EngineDeadError):
        asyncio.run(_collect(llm, "Once", PARAMS, "late"))


@MODES
def test_failed_step_fails_only_its_requests_and_the_loop_goes_on(in_process):
    """The model raises inside a step: that step's requests get StepFailedError (in the
    engine process too, through RequestsFailed), the engine stays alive and serves on."""
    from treadle.config import StepFailedError

    control = StepControl()
    with engine(resolve_model("stories260k"), control=control, in_process=in_process) as llm:

        async def run() -> None:
            group = llm.group()
            try:
                await group.add("doomed", "Once", SamplingParams(max_tokens=300, ignore_eos=True))
                control.fail_next_execute()
                with pytest.raises(StepFailedError, match="model failure injected"):
                    async for _ in group:
                        pass
            finally:
                group.close()

        asyncio.run(asyncio.wait_for(run(), 30))
        assert llm.is_alive() and llm.health() is None
        wait_until(lambda: idle(llm), 10, "the failed request's blocks back")
        assert llm.num_open_requests == 0
        assert asyncio.run(_collect(llm, "Once", PARAMS, "after"))[-1].finished


def test_killed_engine_process_fails_requests_within_seconds():
    control = StepControl(step_delay=0.05)
    with engine(resolve_model("stories260k"), control=control) as llm:
        assert isinstance(llm, EngineCoreClient)

        async def run():
            outs = []
            with pytest.raises(EngineDeadError, match="died"):
                async for out in llm.generate("Once", SamplingParams(max_tokens=300, ignore_eos=True), "x"):
                    outs.append(out)
                    if len(outs) == 2:
                        os.kill(llm.engine_pid, signal.SIGKILL)
            return outs

        assert len(asyncio.run(asyncio.wait_for(run(), 10))) >= 2
        assert not llm.is_alive() and "dead" in (llm.health() or "")
        with pytest.raises(EngineDeadError):
            asyncio.run(_collect(llm, "Once", PARAMS, "late"))


def test_utility_calls_run_in_the_engine_process():
    with engine(resolve_model("stories260k")) as llm:
        assert isinstance(llm, EngineCoreClient)

        async def run():
            pid = await llm.call_utility("ping")
            snap = await llm.call_utility("snapshot")
            with pytest.raises(TreadleError, match="no utility call"):
                await llm.call_utility("nope")
            return pid, snap

        pid, snap = asyncio.run(run())
        assert pid == llm.engine_pid != os.getpid() and snap["num_blocks"] == ENGINE_KW["num_kv_blocks"]


def test_async_llm_as_vllm_users_write_it():
    """`from treadle import AsyncLLM, EngineArgs`, from_engine_args, generate(sampling_params=...),
    and an abort from outside the loop: the generator ends with a finish_reason "abort" output
    (it used to wait forever), and ``await engine.abort(...)`` works as in vLLM."""
    from treadle import AsyncLLM, EngineArgs

    llm = AsyncLLM.from_engine_args(EngineArgs(model="stories260k", **ENGINE_KW))
    try:
        async def run() -> list:
            outs = []
            async for out in llm.generate("Once upon a time", sampling_params=SamplingParams(
                    max_tokens=400, ignore_eos=True), request_id="outside"):
                outs.append(out)
                if len(out.outputs[0].token_ids) == 2:
                    await llm.abort("outside")
            return outs

        outs = asyncio.run(asyncio.wait_for(run(), 30))
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        wait_until(lambda: idle(llm), 10, "the abort to free the request's blocks")
        assert llm.num_open_requests == 0
    finally:
        llm.shutdown()
