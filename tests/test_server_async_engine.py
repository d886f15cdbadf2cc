"""AsyncLLM on its own: the step-loop thread, per-request streams, abort, failures."""
from __future__ import annotations

import asyncio

import pytest
from server_harness import ENGINE_KW, wait_until

from treadle import LLM, SamplingParams
from treadle.config import TreadleError
from treadle.engine.async_engine import AsyncLLM, EngineDeadError
from treadle.loaders.resolve import resolve_model

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    engine = AsyncLLM.from_args(str(resolve_model("stories260k")), **ENGINE_KW)
    yield engine
    engine.shutdown()


def idle(llm: AsyncLLM) -> bool:
    s = llm.snapshot
    return s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_blocks


async def _collect(llm: AsyncLLM, prompt, params: SamplingParams, rid: str) -> list:
    return [out async for out in llm.generate(prompt, params, rid)]


def test_concurrent_generate_matches_offline(llm):
    prompts = ["Once upon a time", "The cat", "Lily had a"]

    async def run():
        return await asyncio.gather(*[_collect(llm, p, PARAMS, f"r{i}") for i, p in enumerate(prompts)])

    streams = asyncio.run(run())
    ref = LLM(str(resolve_model("stories260k")), **ENGINE_KW).generate(prompts, PARAMS, use_tqdm=False)
    for outs, expected in zip(streams, ref):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert "".join(o.outputs[0].new_text for o in outs) == expected.outputs[0].text
        assert outs[-1].outputs[0].token_ids == expected.outputs[0].token_ids
    assert llm.num_open_requests == 0 and llm.health() is None


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


def test_shutdown_fails_open_requests_instead_of_hanging():
    llm = AsyncLLM.from_args(str(resolve_model("stories260k")), **ENGINE_KW)
    llm.set_step_delay(0.05)

    async def run():
        outs = []
        with pytest.raises(EngineDeadError):
            async for out in llm.generate("Once", SamplingParams(max_tokens=300, ignore_eos=True), "x"):
                outs.append(out)
                if len(outs) == 2:
                    await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
        return outs

    assert len(asyncio.run(run())) >= 2
    assert llm.health() is not None and not llm.is_alive()
    with pytest.raises(EngineDeadError):
        asyncio.run(_collect(llm, "Once", PARAMS, "late"))


def test_failed_step_fails_only_its_requests_and_the_loop_goes_on(llm):
    """Params corrupted after admission (a stop id outside the vocabulary) make the sampler
    raise inside a step: that request gets StepFailedError, the engine stays alive."""
    from treadle.engine.llm_engine import StepFailedError

    params = SamplingParams(temperature=0.0, max_tokens=300, min_tokens=299, ignore_eos=True)  # masked throughout

    async def run() -> None:
        group = llm.group()
        await group.add("doomed", "Once", params)
        params.stop_token_ids.append(10**9)
        with pytest.raises(StepFailedError):
            async for _ in group:
                pass

    asyncio.run(run())
    assert llm.is_alive() and llm.health() is None
    wait_until(lambda: idle(llm), 10, "the failed request's blocks back")
    assert asyncio.run(_collect(llm, "Once", PARAMS, "after"))[-1].finished
