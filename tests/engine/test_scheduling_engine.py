"""Scheduling policies through the real engine (stories260k and its shipped length predictor):
outputs do not depend on the policy, and ``predicted`` really reorders."""
from __future__ import annotations

import pytest

from treadle.config import TreadleError
from treadle.core.cost_policy import predicted_remaining
from treadle.entrypoints.llm import LLM
from treadle.predict import prompt_set
from treadle.sampling_params import SamplingParams

PROMPTS = [p.text for p in prompt_set.load(split="heldout")][::7][:8]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=m) for m in (60, 4, 90, 12, 3, 40, 7, 75)]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: a tiny model runs faster on one thread


def run(policy: str, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM("stories260k", scheduling_policy=policy, max_num_seqs=2, **kw)
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], llm


def test_greedy_outputs_identical_under_fcfs_and_predicted():
    fcfs, _ = run("fcfs")
    predicted, llm = run("predicted")
    assert llm.engine.length_predictor is not None  # the shipped one, found for the model
    assert predicted == fcfs
    tight, llm = run("predicted", num_kv_blocks=20, block_size=8)  # KV pressure: victims by predicted cost
    assert llm.engine.stats.num_preemptions > 0
    assert tight == fcfs


def test_predicted_admits_the_shortest_predicted_first():
    """All queued at once, one slot: requests finish in predicted-cost order, not arrival."""
    llm = LLM("stories260k", scheduling_policy="predicted", max_num_seqs=1)
    try:
        eng = llm.engine
        for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
            eng.add_request(str(i), prompt, params, arrival_time=0.0)
        costs = {r.request_id: eng.scheduler.policy.queue_key(r) for r in eng.scheduler.requests.values()}
        order = []
        while eng.has_unfinished_requests():
            order += [o.request_id for o in eng.step() if o.finished]
    finally:
        llm.shutdown()
    assert order == sorted(costs, key=lambda rid: costs[rid])
    assert order != [str(i) for i in range(len(PROMPTS))]


def test_a_request_that_cannot_stop_early_is_predicted_at_its_max_tokens():
    """With EOS ignored and no stop strings or ids, the output length is max_tokens exactly: the
    cost policy and the router's load (``/load``'s predicted remaining tokens) take that, not the
    predictor's guess at where EOS comes; with a stop string the guess stands."""
    llm = LLM("stories260k", scheduling_policy="predicted")
    try:
        eng = llm.engine
        guess = eng.length_predictor.predict([eng.tokenizer.encode(PROMPTS[0])])[0]
        assert guess != 300
        for rid, params in (("exact", SamplingParams(max_tokens=300, ignore_eos=True)),
                            ("stop", SamplingParams(max_tokens=300, ignore_eos=True, stop=["."])),
                            ("eos", SamplingParams(max_tokens=300))):
            eng.add_request(rid, PROMPTS[0], params)
        predicted = {r.request_id: r.predicted_output_tokens for r in eng.scheduler.requests.values()}
        assert predicted == {"exact": 300, "stop": guess, "eos": guess}
        remaining = sum(predicted_remaining(r) for r in eng.scheduler.requests.values())  # what /load reports
        assert remaining == 300 + 2 * min(guess, 300)
    finally:
        llm.shutdown()


def test_bad_scheduling_settings_are_clear_errors(tmp_path):
    with pytest.raises(TreadleError, match="scheduling_policy"):
        LLM("stories260k", scheduling_policy="sjf")
    with pytest.raises(TreadleError, match="cannot read the length predictor"):
        LLM("stories260k", scheduling_policy="predicted", length_predictor=str(tmp_path))
