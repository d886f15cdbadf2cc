"""Metric arithmetic of `treadle bench` on hand-made timelines (vLLM's definitions)."""
from __future__ import annotations

import math

import pytest

from treadle.bench.metrics import KVWaste, RequestRecord, Spread, parse_goodput, peak_concurrency, summarize
from treadle.bench.passages import CHAT_QUESTIONS
from treadle.bench.roofline import MachinePeaks, ModelShape, Roofline
from treadle.bench.serve_client import Traffic
from treadle.bench.workloads import LengthRange, WorkloadSpec, make_workload


def timelines() -> list[RequestRecord]:
    return [
        RequestRecord(10, 0.0, [0.1, 0.15, 0.25, 0.3]),  # 4 tokens, one per chunk
        RequestRecord(20, 1.0, [1.5]),  # a single token: no TPOT
        RequestRecord(30, 0.0, [0.2, 0.4, 0.7], output_tokens=6),  # chunks bundle tokens (usage says 6)
        RequestRecord(40, 0.5, [], success=False, error="HTTP 500"),
    ]


def test_per_request_metrics():
    a, b, c, _ = timelines()
    assert a.ttft == pytest.approx(0.1) and a.e2el == pytest.approx(0.3)
    assert a.itls == pytest.approx([0.05, 0.1, 0.05])
    assert a.tpot == pytest.approx(0.2 / 3)  # (E2E - TTFT) / (n - 1)
    assert b.ttft == pytest.approx(0.5) and b.tpot is None and b.itls == []
    assert c.num_output_tokens == 6 and c.tpot == pytest.approx(0.5 / 5)  # tokens, not chunks


def test_summary_throughput_percentiles_and_goodput():
    m = summarize(timelines(), duration_s=2.0, percentiles=[50, 90, 99], slos={"ttft": 200, "tpot": 70})
    assert (m.completed, m.failed) == (3, 1)
    assert m.total_input_tokens == 60 and m.total_output_tokens == 11
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(5.5)
    assert m.total_token_throughput == pytest.approx(35.5)
    # TTFTs 100, 500, 200 ms: linear interpolation between closest ranks
    assert m.ttft_ms.mean == pytest.approx(800 / 3)
    assert m.ttft_ms.median == pytest.approx(200)
    assert m.ttft_ms.percentiles["p90"] == pytest.approx(200 + 0.8 * 300)
    # TPOT over requests with > 1 token: 66.7 and 100 ms
    assert m.tpot_ms.median == pytest.approx((200 / 3 + 100) / 2)
    # ITLs pooled over requests: 50, 100, 50, 200, 300 ms
    assert m.itl_ms.mean == pytest.approx(140) and m.itl_ms.median == pytest.approx(100)
    assert m.e2el_ms.percentiles["p99"] == pytest.approx(500 + 0.98 * 200)
    # goodput: a meets both SLOs; b misses TTFT; c meets TTFT exactly (<=) but misses TPOT
    assert m.request_goodput == pytest.approx(0.5)
    assert m.max_concurrency_seen == 2


def test_single_token_request_counts_tpot_zero_for_goodput():
    m = summarize([RequestRecord(5, 0.0, [0.1])], 1.0, slos={"tpot": 1})
    assert m.request_goodput == pytest.approx(1.0)
    assert m.tpot_ms.mean == 0.0  # no TPOT samples: reported as 0, as vLLM does


def test_goodput_absent_without_slos_and_parse_errors():
    assert summarize(timelines(), 1.0).request_goodput is None
    assert parse_goodput(["ttft:500", "TPOT:50", "e2el:3000"]) == {"ttft": 500, "tpot": 50, "e2el": 3000}
    for bad in (["itl:5"], ["ttft"], ["ttft:-1"], ["ttft:x"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_peak_concurrency_half_open():
    recs = [RequestRecord(1, 0.0, [1.0]), RequestRecord(1, 1.0, [2.0]), RequestRecord(1, 0.5, [1.5])]
    assert peak_concurrency(recs) == 2  # the first ends exactly when the second starts


def test_spread_and_kv_waste():
    s = Spread.of([3.0, 1.0, 2.0])
    assert (s.median, s.lo, s.hi) == (2.0, 1.0, 3.0) and s.fmt(0) == "2 (1-3)"
    kv = KVWaste()
    kv.observe(64, 60)
    kv.observe(32, 32)  # not a new peak
    assert kv.waste_fraction == pytest.approx(4 / 64)


def test_arrivals_seeded_poisson():
    gaps = Traffic(request_rate=4.0, seed=3).arrival_gaps(4000)
    assert gaps == Traffic(request_rate=4.0, seed=3).arrival_gaps(4000)
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.05)
    assert Traffic().arrival_gaps(3) == [0.0, 0.0, 0.0]  # rate inf: all at once


def test_workloads_seeded_and_shaped():
    spec = WorkloadSpec("random", 50, LengthRange.parse("32:512"), LengthRange.parse("16:256"), seed=7)
    reqs = make_workload(spec, vocab_size=1000)
    assert reqs == make_workload(spec, vocab_size=1000)
    assert all(32 <= r.prompt_len <= 512 and 16 <= r.output_len <= 256 for r in reqs)
    assert all(100 <= t < 1000 for r in reqs for t in r.prompt_token_ids)
    salted = make_workload(spec, vocab_size=1000, token_salt=1)
    assert [r.prompt_len for r in salted] == [r.prompt_len for r in reqs]
    assert salted[0].prompt_token_ids != reqs[0].prompt_token_ids
    shared = make_workload(WorkloadSpec("shared-prefix", 6, LengthRange(8, 8), LengthRange(4, 4), prefix_len=64,
                                        num_prefixes=2), 500)
    assert shared[0].prompt_token_ids[:64] == shared[2].prompt_token_ids[:64] != shared[1].prompt_token_ids[:64]
    assert all(r.prompt_len == 72 for r in shared)
    chat = make_workload(WorkloadSpec("chat", 200), 500, max_total_len=600)
    assert all(8 <= r.output_len <= 512 and r.prompt_len + r.output_len <= 600 for r in chat)
    assert {r.prompt_len for r in make_workload(WorkloadSpec("fixed", 3, LengthRange(9, 9)), 500)} == {9}
    mixed = make_workload(WorkloadSpec("mixed", 4, LengthRange(8, 300), LengthRange(2, 40)), 500)
    assert [(r.prompt_len, r.output_len) for r in mixed] == [(8, 40), (300, 2), (8, 40), (300, 2)]
    with pytest.raises(ValueError):
        LengthRange.parse("10:5")


def test_chat_text_workload_is_chat_turns_of_fixed_output_length():
    from treadle.loaders import open_model_source

    tok = open_model_source("smollm2-135m-instruct").tokenizer  # has a chat template
    spec = WorkloadSpec("chat-text", 5, output_len=LengthRange(16, 40))
    reqs = make_workload(spec, 512, tokenizer=tok)
    assert reqs == make_workload(spec, 512, tokenizer=tok) and len(reqs) == 5
    assert {r.output_len for r in reqs} == {40} and all(r.prompt_len > 5 for r in reqs)
    assert len(make_workload(spec, 512, tokenizer=tok, token_salt=-1)) == len(CHAT_QUESTIONS)
    with pytest.raises(ValueError, match="tokenizer"):
        make_workload(spec, 512)


def test_roofline_bounds():
    shape = ModelShape(linear_params=1_000_000, num_layers=2, q_width=64, kv_bytes_per_token=1024)
    roof = Roofline(MachinePeaks(mem_bandwidth=1e9, matmul_flops=1e10, dtype="float32", threads=1), shape,
                    weight_bytes=4_000_000)
    # batch 1, context 100: reads 4 MB + 100 KB -> 4.1 ms; computes 2.05 MFLOP -> 0.2 ms: memory bound
    assert roof.decode_step_time(1, 100) == pytest.approx(4.1024e-3)
    assert roof.decode_tokens_per_s(1, 100) == pytest.approx(1 / 4.1024e-3)
    # prefill of 1000 tokens: compute bound, FLOPs at mean context 500, logits for the last token only
    shape_with_head = ModelShape(1_000_000, 2, 64, 1024, lm_head_params=500_000)
    roof_head = Roofline(roof.peaks, shape_with_head, 4_000_000)
    assert roof_head.prefill_time(1000) == pytest.approx((1000 * (2e6 + 4 * 2 * 500 * 64) + 1e6) / 1e10)
    assert roof_head.decode_step_time(1, 100) == roof.decode_step_time(1, 100)  # still memory bound
    flops = 1000 * (2e6 + 4 * 2 * 500 * 64)
    assert roof.prefill_time(1000) == pytest.approx(flops / 1e10)
    assert math.isfinite(roof.workload_time(make_workload(WorkloadSpec("fixed", 4), 500), 2))
