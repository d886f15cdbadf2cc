"""Speculation over HTTP: greedy completions equal the offline plain ones, and /metrics
carries the spec_decode counters (vLLM's names with our prefix)."""
from __future__ import annotations

import httpx
import pytest
from server_harness import ENGINE_KW, MODEL_NAME, ServerThread, engine_idle, metric_values, wait_until

from treadle import LLM, SamplingParams
from treadle.engine.client.in_process import AsyncLLM
from treadle.server.app import build_app

pytestmark = pytest.mark.server  # starts processes (servers, workers)

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "fallback": False}
PROMPT = "Tom had a big red ball. Tom had a big red ball. Tom had"


def test_metrics_and_output_with_speculation() -> None:
    plain = LLM("stories260k", **ENGINE_KW).generate(PROMPT, SamplingParams(temperature=0, max_tokens=30,
                                                                              ignore_eos=True), use_tqdm=False)
    llm = AsyncLLM.from_args("stories260k", speculative_config=NGRAM, **ENGINE_KW)
    try:
        with ServerThread(build_app(llm, MODEL_NAME)) as srv:
            r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT,
                           "max_tokens": 30, "temperature": 0, "ignore_eos": True}, timeout=60).json()
            assert r["choices"][0]["text"] == plain[0].outputs[0].text
            wait_until(lambda: engine_idle(srv.url), 10, "the engine to go idle")
            m = metric_values(srv.url)
    finally:
        llm.shutdown()
    drafts, accepted = m["treadle:spec_decode_num_drafts_total"], m["treadle:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and accepted > 0
    assert m["treadle:spec_decode_num_emitted_tokens_total"] == drafts + accepted
    assert m["treadle:spec_decode_num_accepted_tokens_per_pos_total{position=0}"] > 0
    assert sum(v for k, v in m.items() if "per_pos" in k) == accepted
    assert m["treadle:spec_decode_mean_acceptance_length"] == round((drafts + accepted) / drafts, 3)
    assert "treadle:spec_decode_num_batch_fallbacks_total" in m
