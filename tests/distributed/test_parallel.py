"""Tensor and pipeline parallelism with real worker processes over gloo on 127.0.0.1 (one
thread per rank): greedy tokens identical to one rank and logprobs close, with prefix caching
and SplitFuse on (16-token steps chunk the prompts and mix them with decodes; the second
round hits the prefix cache); a killed rank is a clear error and an unhealthy engine."""
from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_run import assert_no_leaks
from tiny_models import make_tiny_model

from treadle import LLM, SamplingParams
from treadle.config import EngineDeadError
from treadle.distributed.overlap import TokenSplit, split_tokens

pytestmark = [pytest.mark.server, pytest.mark.usefixtures("one_thread")]  # every test starts ranks

KW = dict(num_kv_blocks=96, block_size=8, max_num_batched_tokens=16, enable_prefix_caching=True, max_model_len=256)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
SHARED = "Once upon a time there was a little girl named Lily who"
PROMPTS = [SHARED + " loved the park", SHARED + " had a red ball", "The dog ran", {"prompt_token_ids": [7] * 30}]


def run(llm: LLM) -> list:
    """Two rounds of the prompts (the second reuses cached prefix blocks)."""
    return [(c.token_ids, c.logprobs) for _ in range(2)
            for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False) for c in o.outputs]


def assert_same(got: list, want: list) -> None:
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want, strict=True):
        assert tokens == want_tokens
        for lp, want_lp in zip(lps, want_lps, strict=True):  # logits close: same top-2, close values
            assert lp.keys() == want_lp.keys()
            assert all(math.isclose(lp[t].logprob, want_lp[t].logprob, abs_tol=2e-3) for t in lp)


def reference(model: str, **kw: object) -> list:
    llm = LLM(model, **KW, **kw)
    try:
        return run(llm)
    finally:
        llm.shutdown()


def checked_run(llm: LLM) -> list:
    assert llm.engine.config.parallel.distributed_executor_backend == "mp"
    out = run(llm)
    assert llm.engine.kv_manager.pool.num_blocks == 96 and llm.engine.health() is None
    return out


def parallel(model: str, tp: int, pp: int = 1, **kw: object) -> list:
    llm = LLM(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, **KW, **kw)
    try:
        return checked_run(llm)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def stories_reference() -> list:
    return reference("stories260k")


@pytest.fixture(scope="module")
def stories_pp2() -> Iterator[LLM]:
    """One PP=2 engine (batch queue on, the default) for the two tests that run it: starting
    ranks costs far more than the runs. Whichever runs first sees a cold prefix cache."""
    llm = LLM("stories260k", pipeline_parallel_size=2, **KW)
    try:
        yield llm
    finally:
        llm.shutdown()


class SharedEngine:
    """A module's engine, started on first use; ``take()`` hands it to a test that will break it
    (kill a rank) and shut it down: whoever asks next gets a fresh one."""

    def __init__(self, **kw: object) -> None:
        self.kw, self.llm = kw, None

    def get(self) -> LLM:
        if self.llm is None:
            self.llm = LLM("stories260k", **self.kw)
        return self.llm

    def take(self) -> LLM:
        llm, self.llm = self.get(), None
        return llm


@pytest.fixture(scope="module")
def stories_tp2() -> Iterator[SharedEngine]:
    """One TP=2 engine for the token-identity test and then the killed-rank test, which takes it
    (starting two ranks costs more than either test's run)."""
    shared = SharedEngine(tensor_parallel_size=2, **KW)
    try:
        yield shared
    finally:
        if shared.llm is not None:
            shared.llm.shutdown()


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2xpp2"])
def test_stories260k_is_token_identical_to_one_rank(stories_reference: list, request: pytest.FixtureRequest,
                                                    tp: int, pp: int) -> None:
    if (tp, pp) == (1, 2):
        assert_same(checked_run(request.getfixturevalue("stories_pp2")), stories_reference)
    elif (tp, pp) == (2, 1):
        assert_same(checked_run(request.getfixturevalue("stories_tp2").get()), stories_reference)
    else:
        assert_same(parallel("stories260k", tp, pp), stories_reference)


@pytest.mark.parametrize(("arch", "overrides", "quantization", "tp", "pp"), [
    ("qwen2", {}, None, 2, 1),  # qkv bias, 4 heads / 2 KV heads: one KV head a rank
    ("qwen2", {}, None, 1, 2),
    ("mistral", dict(num_key_value_heads=1), None, 2, 1),  # T > KV heads: the KV head replicated
    ("mistral", dict(num_key_value_heads=1), None, 2, 2),
    ("llama", dict(intermediate_size=192), "int8", 2, 1),  # Q8_0 blocks: row-parallel cut at block boundaries
], ids=["qwen2-tp2", "qwen2-pp2", "mistral-kv1-tp2", "mistral-kv1-tp2xpp2", "llama-int8-tp2"])
def test_random_models_are_token_identical(tmp_path: Path, arch: str, overrides: dict,
                                           quantization: str | None, tp: int, pp: int) -> None:
    model = str(make_tiny_model(tmp_path / arch, arch, **overrides))
    kw = {} if quantization is None else dict(quantization=quantization)
    assert_same(parallel(model, tp, pp, **kw), reference(model, **kw))


@pytest.fixture
def tp2(stories_tp2: SharedEngine) -> Iterator[LLM]:
    llm = stories_tp2.take()  # the shared TP=2 engine (or a fresh one): this test kills a rank
    try:
        yield llm
    finally:
        llm.shutdown()


def test_killed_rank_is_a_clear_error_and_an_unhealthy_engine(tp2: LLM) -> None:
    engine = tp2.engine
    engine.add_request("a", "Once upon a time", SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    pids = engine.executor.worker_pids
    os.kill(pids[0], signal.SIGKILL)  # rank 1 is left waiting in a collective
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match="killed by SIGKILL") as info:
        for _ in range(1000):
            engine.step()
    assert time.monotonic() - t0 < 5.0 and "\n" not in str(info.value)
    assert engine.health() is not None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") and not _zombie(p) for p in pids):
        time.sleep(0.1)
    assert all(not os.path.exists(f"/proc/{p}") or _zombie(p) for p in pids)  # the survivor is gone too


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_overlapped_micro_batches_are_token_identical(stories_reference: list) -> None:
    """comm_overlap: each step cut in two (a prompt chunk may be cut mid-request), the halves'
    all-reduces overlapping each other's compute: the same tokens."""
    assert_same(parallel("stories260k", 2, comm_overlap=True), stories_reference)


def test_pipeline_batch_queue_keeps_two_steps_in_flight(stories_reference: list, stories_pp2: LLM) -> None:
    """PP=2 keeps a step per stage in flight (the batch queue): the same tokens as one rank and
    as PP=2 with one step in flight, and a request aborted while its step is out frees its
    blocks once that step comes back (nothing leaks)."""
    llm = stories_pp2
    assert llm.engine.executor.max_concurrent_batches == 2
    llm.engine.stats.max_steps_in_flight = 0  # a high-water mark: this test's run must reach 2 itself
    assert_same(run(llm), stories_reference)
    assert llm.get_stats()["max_steps_in_flight"] == 2
    engine = llm.engine
    for i in range(4):
        engine.add_request(f"r{i}", PROMPTS[i], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request("r1")  # its blocks stay taken while its step is in flight
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(llm)


def test_pipeline_without_batch_queue_is_the_same(stories_reference: list, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREADLE_PP_BATCH_QUEUE", "0")
    llm = LLM("stories260k", pipeline_parallel_size=2, **KW)
    try:
        assert_same(run(llm), stories_reference)
        assert llm.get_stats()["max_steps_in_flight"] == 1
    finally:
        llm.shutdown()


def test_token_split_cuts_a_request_in_two() -> None:
    a, b = split_tokens([3, 5, 1], [10, 5, 7], [[0], [1], [2]], at=5)
    assert a == TokenSplit([3, 2], [10, 2], [[0], [1]])
    assert b == TokenSplit([3, 1], [5, 7], [[1], [2]])


@pytest.mark.slow
@pytest.mark.usefixtures("sixteen_bit_activations")
def test_smollm2_gguf_blocks_at_tp3_and_pp2_are_token_identical() -> None:
    """The real Q4_1 GGUF file: 9 heads / 3 KV heads over 3 ranks, every linear layer and the
    tied embedding kept as blocks, cut only at 32-input block boundaries; and in two stages.
    16-bit activations: with 8-bit ones the ranks' different float summation order flips some
    int8 roundings downstream, and logprobs move by more than this test's 2e-3."""
    kw = dict(max_tokens=8, logprobs=2)
    params = SamplingParams(temperature=0.0, ignore_eos=True, **kw)
    prompts = ["The capital of France is", "Write a haiku about the sea:"]
    small = dict(num_kv_blocks=32, max_num_batched_tokens=16, max_model_len=128)

    def outputs(llm: LLM) -> list:
        try:
            return [(c.token_ids, c.logprobs) for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]
        finally:
            llm.shutdown()

    want = outputs(LLM("smollm2-135m-instruct", **small))
    assert_same(outputs(LLM("smollm2-135m-instruct", tensor_parallel_size=3, **small)), want)
    assert_same(outputs(LLM("smollm2-135m-instruct", pipeline_parallel_size=2, **small)), want)
