"""Speculative decoding, unit level: the config, the n-gram proposer, the scheduler's
lookahead slots and rollback (hand-built runner outputs), the fallback controller, the
verifier (greedy, and its distribution against plain sampling), and attention with
verify-shaped query lengths."""
from __future__ import annotations

import argparse
import math

import pytest
import torch
from paged_session import scattered_block_tables

from treadle.config import SchedulerConfig, SpeculativeConfig, TreadleError
from treadle.core.kv_cache_manager import KVCacheManager
from treadle.core.request import Request, RequestStatus
from treadle.core.scheduler import Scheduler
from treadle.core.spec_fallback import FallbackController
from treadle.core.step_data import ModelRunnerOutput, SchedulerOutput
from treadle.engine.cli_args import add_engine_args, engine_kwargs
from treadle.layers.attention import AttentionSpec, ReferenceBackend, build_attention_metadata
from treadle.layers.attention.cpu import CPUBackend
from treadle.sample.rejection_sampler import verify
from treadle.sample.sampler import Sampler, SamplingRow
from treadle.sampling_params import SamplingParams
from treadle.spec_decode.ngram import NgramProposer
from treadle.spec_decode.options import resolve_speculative
from treadle.spec_decode.proposer import DraftLength, ProposerStep, RequestProgress

# -- config ---------------------------------------------------------------------------------


def test_speculative_config_from_dict_json_and_cli() -> None:
    assert resolve_speculative(None) is None and resolve_speculative("") is None
    cfg = resolve_speculative({"method": "ngram", "num_speculative_tokens": 3})
    assert cfg == SpeculativeConfig("ngram", 3, 2, 4, True)
    assert resolve_speculative('{"method": "ngram", "prompt_lookup_min": 1, "fallback": false}') == \
        SpeculativeConfig("ngram", 4, 1, 4, False)
    p = argparse.ArgumentParser()
    add_engine_args(p)
    kw = engine_kwargs(p.parse_args(["--speculative-config", '{"method": "ngram"}']))
    assert resolve_speculative(kw["speculative_config"]).method == "ngram"
    assert engine_kwargs(p.parse_args([]))["speculative_config"] is None


@pytest.mark.parametrize("raw,match", [
    ("{nope", "not valid JSON"), ('["ngram"]', "JSON object"), ({"method": "magic"}, "not one of"),
    ({"method": "ngram", "k": 2}, "unknown speculative_config key 'k'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "at least 1"),
    ({"method": "ngram", "prompt_lookup_min": 5}, "must not exceed"),
    ({"method": "ngram", "fallback": "yes"}, "true or false"),
    ({"method": "eagle", "model": 3}, "draft-head directory"),
])
def test_speculative_config_errors_are_one_line(raw: object, match: str) -> None:
    with pytest.raises(TreadleError, match=match) as info:
        resolve_speculative(raw)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


# -- n-gram proposer --------------------------------------------------------------------------


def test_ngram_proposes_the_continuation_of_the_latest_match() -> None:
    p = NgramProposer(3, 2, 4)
    assert p.lookup([1, 2, 3, 4, 5, 9, 2, 3]) == [4, 5, 9]
    assert p.lookup([1, 2, 3, 4, 1, 2, 3, 7, 1, 2, 3]) == [7, 1, 2]  # latest of two matches, longest n
    assert p.lookup([5, 6, 7, 8]) == []  # nothing recurs
    assert p.lookup([1, 2, 3, 1, 2]) == [3, 1, 2]
    assert p.lookup([1, 2, 3, 1, 2], max_drafts=1) == [3]
    assert p.lookup([1, 2, 9, 1, 2]) == [9, 1, 2]
    assert NgramProposer(3, 3, 3).lookup([1, 2, 9, 1, 2]) == []  # a 2-gram is below the minimum


def _progress(rid: str, tokens: list[int], drafts: int = 0, accepted: int = 0) -> RequestProgress:
    return RequestProgress(rid, tokens, [0], len(tokens) - 1 - drafts, accepted + 1, 0, True, 16, drafts, accepted)


def test_draft_length_follows_the_last_verify() -> None:
    length = DraftLength(8, start=4)
    assert length.of(_progress("a", [1, 2])) == 4  # nothing verified yet: the start
    assert length.of(_progress("a", [1, 2], drafts=4, accepted=4)) == 8  # all accepted: twice as many
    assert length.of(_progress("a", [1, 2], drafts=8, accepted=8)) == 8  # at most K
    assert length.of(_progress("a", [1, 2], drafts=8, accepted=2)) == 3  # rejected at 3: propose 3
    assert length.of(_progress("a", [1, 2])) == 3  # a plain step changes nothing
    assert length.of(_progress("a", [1, 2], drafts=3, accepted=0)) == 1
    assert length.of(_progress("b", [1, 2])) == 4  # per request
    length.forget(["a"])
    assert length.of(_progress("a", [1, 2])) == 4


def test_ngram_proposer_drafts_as_many_as_recent_verifies_earn() -> None:
    p = NgramProposer(6, 1, 3)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    step = lambda drafts, accepted: ProposerStep([_progress("r", tokens, drafts, accepted)], None)  # noqa: E731
    assert p.propose(step(0, 0)) == {"r": [3, 4, 5, 6]}  # the start: 4
    assert p.propose(step(4, 4)) == {"r": [3, 4, 5, 6, 7, 8]}  # all accepted: up to K = 6
    assert p.propose(step(6, 1)) == {"r": [3, 4]}  # rejected at the second
    p.finish(["r"])
    assert p.propose(step(0, 0)) == {"r": [3, 4, 5, 6]}


# -- scheduler: lookahead slots and rollback ------------------------------------------------


def make_scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 32) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=256,
                          enable_chunked_prefill=True)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size), FallbackController(enabled=False))


def make_req(rid: str, prompt: list[int], max_tokens: int = 20) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), max_tokens, eos_token_ids=(2,))


def step(s: Scheduler, sampled: dict[str, list[int]], drafts: dict[str, list[int]]) -> SchedulerOutput:
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(sampled=sampled, draft_token_ids=drafts))
    return out


def test_drafts_are_lookahead_slots_and_rejections_roll_back() -> None:
    s = make_scheduler()
    r = make_req("a", [10, 11, 12, 13, 14, 15])  # 6 tokens, block size 4
    s.add_request(r)
    step(s, {"a": [20]}, {"a": [21, 22, 23, 24]})
    assert (r.num_computed_tokens, r.num_tokens, r.spec_token_ids) == (6, 7, [21, 22, 23, 24])
    out = s.schedule()
    (sr,) = out.scheduled
    assert (sr.num_computed_tokens, sr.num_scheduled_tokens, sr.draft_token_ids) == (6, 5, [21, 22, 23, 24])
    assert len(sr.block_ids) == 3  # 11 slots: the lookahead is reserved
    # drafts 21 and 22 accepted, 23 rejected -> correction 30
    s.update_from_output(out, ModelRunnerOutput(sampled={"a": [21, 22, 30]}, draft_token_ids={"a": []}))
    assert r.output_token_ids == [20, 21, 22, 30]
    assert r.num_computed_tokens == 9  # 6 + last token + 2 accepted; rejected slots wound back
    assert len(s.kv.block_ids("a")) == 3 and s.kv.num_free_blocks == 61
    # everything rejected: the third block held only rejected drafts and goes back
    r2 = make_req("b", [40, 41, 42, 43, 44, 45, 46])
    s.add_request(r2)
    step(s, {"a": [31], "b": [50]}, {"a": [], "b": [51, 52, 53]})
    free_before = s.kv.num_free_blocks
    out = s.schedule()
    assert [x.draft_token_ids for x in out.scheduled] == [[], [51, 52, 53]]
    assert len(out.scheduled[1].block_ids) == 3 and s.kv.num_free_blocks == free_before - 1  # lookahead block
    s.update_from_output(out, ModelRunnerOutput(sampled={"a": [32], "b": [60]}))
    assert (r2.num_computed_tokens, r2.num_tokens) == (8, 9)
    assert len(s.kv.block_ids("b")) == 2 and s.kv.num_free_blocks == free_before  # given back


def test_prefix_index_never_holds_rejected_tokens() -> None:
    s = make_scheduler()
    r = make_req("a", [10, 11, 12])
    s.add_request(r)
    step(s, {"a": [20]}, {"a": [91, 92, 93, 94, 95]})  # drafts would fill block 1 and spill into 2
    step(s, {"a": [21]}, {})  # every draft rejected
    assert r.num_computed_tokens == 4
    keys = [b.key for b in s.kv._tables["a"][0] if b is not None and b.key is not None]
    assert keys == [(0, (10, 11, 12, 20))]  # only the computed, accepted block
    assert all(b.key is None or not set(b.key[1]) & {91, 92, 93, 94, 95} for b in s.kv.pool.blocks)


def test_drafts_share_the_budget_with_prompt_chunks_and_respect_limits() -> None:
    s = make_scheduler(budget=8)
    r = make_req("a", [1, 3, 4], max_tokens=4)
    s.add_request(r)
    step(s, {"a": [5]}, {"a": [6, 7, 8, 9, 10]})
    assert r.spec_token_ids == [6, 7]  # max_tokens 4: one token is sure, two drafts left
    s.add_request(make_req("b", list(range(100, 120))))
    out = s.schedule()
    assert [(x.request_id, x.num_scheduled_tokens, x.draft_token_ids) for x in out.scheduled] == \
        [("a", 3, [6, 7]), ("b", 5, [])]  # b's first chunk takes what the verify leaves
    s.update_from_output(out, ModelRunnerOutput(sampled={"a": [6, 7, 8]}))
    assert r.status is RequestStatus.FINISHED_LENGTH and r.output_token_ids == [5, 6, 7, 8]


def test_stop_token_inside_accepted_drafts_finishes_and_frees() -> None:
    s = make_scheduler()
    r = make_req("a", [1, 3, 4])
    s.add_request(r)
    step(s, {"a": [5]}, {"a": [6, 2, 7]})
    out = step(s, {"a": [6, 2, 7, 8]}, {})
    assert out.scheduled[0].draft_token_ids == [6, 2, 7]
    assert r.status is RequestStatus.FINISHED_STOPPED and r.output_token_ids == [5, 6, 2]
    assert s.kv.num_free_blocks == 64


def test_preemption_drops_drafts_and_recomputes() -> None:
    s = make_scheduler(num_blocks=4)
    a, b = make_req("a", [1, 3, 4, 5, 6, 7, 8], 8), make_req("b", [9, 10, 11, 12, 13, 14, 15], 8)
    a.arrival_time, b.arrival_time = 0.0, 1.0
    s.add_request(a)
    s.add_request(b)
    step(s, {"a": [20], "b": [30]}, {"a": [21, 22, 23], "b": [31, 32, 33]})
    out = s.schedule()  # a's lookahead needs a third block: b (latest) is preempted
    assert out.num_preemptions == 1 and b.status is RequestStatus.PREEMPTED and b.spec_token_ids == []
    assert [x.request_id for x in out.scheduled] == ["a"] and out.scheduled[0].draft_token_ids == [21, 22, 23]


# -- fallback controller ----------------------------------------------------------------------


def test_fallback_stops_a_slow_batch_size_and_probes_again() -> None:
    c = FallbackController(enabled=True, probe_every=8)
    assert c.speculate_batch(32)  # spec unmeasured: try it
    c.observe_step(32, True, 40, 0.2)  # 200 tokens/s speculating
    assert not c.speculate_batch(32)  # plain unmeasured: probe it
    c.observe_step(32, False, 32, 0.1)  # 320 tokens/s plain
    decisions = [c.speculate_batch(32) for _ in range(16)]
    assert decisions.count(True) == 1  # only the probe speculates (the next one comes later)
    assert c.stats.num_batch_fallbacks == 15 and c.stats.num_probes == 2
    assert c.speculate_batch(1)  # another bucket is measured on its own


def test_fallback_switches_off_a_request_that_does_not_accept() -> None:
    c = FallbackController(enabled=True, probe_every=4)
    c.speculate_batch(1)
    c.observe_step(1, True, 1, 0.13)  # a verify costs 1.3 plain steps: 0.3 accepted drafts to break even
    c.observe_step(1, False, 1, 0.10)
    for _ in range(6):
        c.observe_verify("r", 1, 0)
    assert c.stats.num_request_fallbacks >= 1
    assert not c.speculate_request("r")
    seen = []
    for _ in range(6):
        c.speculate_batch(1)
        seen.append(c.speculate_request("r"))
    assert True in seen and c.stats.num_probes >= 1  # probed again later
    off = FallbackController(enabled=False)
    off.observe_verify("r", 1, 0)
    off.observe_step(1, True, 1, 10.0)
    assert off.speculate_batch(64) and off.speculate_request("r")


# -- the verifier --------------------------------------------------------------------------------


def row(**kw: object) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), [1, 2], [3], (0,))


def test_greedy_verify_accepts_the_argmax_prefix() -> None:
    logits = torch.full((4, 10), -5.0)
    for j, t in enumerate([4, 5, 6, 7]):
        logits[j, t] = 5.0
    s = Sampler(0)
    assert verify(s, logits, row(temperature=0), [4, 5, 6]).tokens == [4, 5, 6, 7]  # all + bonus
    assert verify(s, logits, row(temperature=0), [4, 9, 6]).tokens == [4, 5]  # correction at the mismatch
    assert verify(s, logits, row(temperature=0, logprobs=1), [8, 5, 6]).logprobs[0].token_id == 4
    # a repetition penalty counts accepted drafts as output: 5 is penalised at row 2
    pen = torch.zeros((2, 10))
    pen[0, 5], pen[1, 5], pen[1, 6] = 3.0, 3.0, 2.0
    assert verify(s, pen, row(temperature=0, repetition_penalty=2.0), [5]).tokens == [5, 6]


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a / a.sum() - b / b.sum()).abs().sum())


def tv_bound(num_categories: int, n: int) -> float:
    """n draws from a distribution over K categories against the distribution itself: each cell
    count has standard deviation sqrt(n p_i), so E[TV] <= sum_i sqrt(p_i / n) / 2 <= 0.5 sqrt(K / n)
    (Cauchy-Schwarz); TV's own spread is well below its mean here, so 3x is a safe bound."""
    return 3 * 0.5 * math.sqrt(num_categories / n)


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft-q", "ngram"])
def test_speculative_sampling_has_the_target_distribution(point_mass: bool) -> None:
    """Two positions: the emitted first token and, when the first draft is accepted, the
    second (else a plain step samples it). Their joint distribution must be p1 x p2, the
    target after temperature and top-k. A verifier that resamples from p instead of
    norm(max(p - q, 0)) is off by TV 0.15 here, and "always accept" by more: both far
    above the bound."""
    g = torch.Generator().manual_seed(1)
    V, n = 4, 3000
    logits = torch.randn(3, V, generator=g) * 1.5
    q = torch.softmax(torch.randn(2, V, generator=g) * 2, -1)
    s = Sampler(7)
    base = row(temperature=0.8, top_k=3)
    p1, p2 = s.target_probs(logits[0], base), s.target_probs(logits[1], base)
    target = (p1[:, None] * p2[None, :]).flatten()
    spec = torch.zeros(V * V)
    for _ in range(n):
        drafts = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(2)]
        out = verify(s, logits, base, drafts, None if point_mass else q).tokens
        if len(out) == 1:  # rejected at once: the second token comes from a plain step
            out = [out[0], s.sample_row(logits[1], SamplingRow(base.params, [1, 2], [3, out[0]], (0,)))]
        spec[out[0] * V + out[1]] += 1
    support = int((target > 0).sum())
    bound = tv_bound(support, n)
    assert tv(spec, target) < bound
    always_accept = (q[0][:, None] * q[1][None, :]).flatten()
    assert tv(always_accept, target) > 3 * bound  # the test can tell a biased verifier


@pytest.mark.parametrize("filters", [{}, {"top_p": 0.9, "top_k": 8}, {"min_p": 0.1}])
def test_seeded_ngram_verify_gives_the_plain_seeded_tokens(filters: dict) -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 12, generator=g)
    s = Sampler(0)
    base = row(temperature=1.0, seed=11, **filters)
    plain, out = [], list(base.output_token_ids)
    for j in range(4):
        plain.append(s.sample_row(logits[j], SamplingRow(base.params, [1, 2], out + plain, (0,))))
    got = verify(s, logits, base, plain[:3]).tokens
    assert got == plain  # every draft is the plain token: all accepted, the bonus too


# -- attention with verify-shaped query lengths -------------------------------------------------


def dense_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta, spec: AttentionSpec) -> torch.Tensor:
    """Oracle: per sequence, gather its whole context from the (written) cache and attend
    causally with plain matmuls."""
    out, at, bs = [], 0, meta.block_size
    for i, (ql, sl) in enumerate(zip(meta.query_lens, meta.seq_lens)):
        pos = torch.arange(sl)
        slots = meta.block_tables[i].long()[pos // bs] * bs + pos % bs
        k = kc.flatten(0, 1)[slots].repeat_interleave(spec.num_heads // spec.num_kv_heads, 1)
        v = vc.flatten(0, 1)[slots].repeat_interleave(spec.num_heads // spec.num_kv_heads, 1)
        qi = q[at : at + ql]
        scores = torch.einsum("qhd,khd->hqk", qi.double(), k.double()) * spec.scale
        mask = pos[None, :] > torch.arange(sl - ql, sl)[:, None]
        scores = scores.masked_fill(mask, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()))
        at += ql
    return torch.cat(out).float()


@pytest.mark.parametrize("backend_cls", [ReferenceBackend, CPUBackend], ids=["reference", "cpu"])
def test_verify_rows_mixed_with_prompt_chunks_and_decodes(backend_cls: type) -> None:
    """1 + K query rows per speculating request (K = 4, 2), beside plain decodes and prompt
    chunks, against a dense oracle."""
    g = torch.Generator().manual_seed(5)
    query_lens, seq_lens, bs = [5, 1, 37, 3, 1, 12], [40, 17, 37, 130, 64, 29], 16
    heads, kv_heads, hd = 8, 2, 32
    tables, num_blocks = scattered_block_tables(seq_lens, bs, g, spare=3)
    shape = (num_blocks, bs, kv_heads, hd)
    kc, vc = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    n = sum(query_lens)
    q, k, v = (torch.randn(n, h, hd, generator=g) for h in (heads, kv_heads, kv_heads))
    meta = build_attention_metadata(query_lens, seq_lens, tables, bs)
    spec = AttentionSpec(heads, kv_heads, hd, hd**-0.5, None)
    backend = backend_cls()
    meta.plan = backend.plan(meta)
    out = backend.forward(q, k, v, kc, vc, meta, spec)
    torch.testing.assert_close(out.reshape(n, heads, hd), dense_attention(q, kc, vc, meta, spec),
                               atol=2e-5, rtol=1e-4)



def test_fallback_switches_off_a_request_that_accepts_nothing_even_when_timing_is_noise() -> None:
    """On a busy machine a verify step can be measured faster than a plain one; a request that
    accepts nothing must still stop (the cost ratio is at least MIN_COST_RATIO)."""
    c = FallbackController(enabled=True, probe_every=4)
    c.speculate_batch(1)
    c.observe_step(1, True, 1, 0.08)  # noise: the verify step looked cheaper than the plain one
    c.observe_step(1, False, 1, 0.10)
    for _ in range(12):  # the acceptance EMA starts optimistic (1.0) and must fall below 0.1
        c.observe_verify("r", 1, 0)
    assert c.stats.num_request_fallbacks >= 1 and not c.speculate_request("r")

def test_fallback_predicts_a_large_batch_from_the_step_cost_model() -> None:
    """Steps cost 10 ms + 2 ms per row; drafts of 4 with 1 accepted per verify pay at batch 1
    (2 tokens in 20 ms vs 1 in 12) but not at 32 (64 tokens in 330 ms vs 32 in 74): the
    controller does not even try speculation at 32."""
    c = FallbackController(enabled=True, probe_every=8)
    for rows in (1, 5, 2, 10, 3):
        c.observe_step(1, rows > 3, 1, 0.010 + 0.002 * rows, rows)
    for _ in range(4):
        c.stats.record_verify(4, 1)
    assert c._predicted_to_pay(1) is True
    assert not c.speculate_batch(32) and c.stats.num_batch_fallbacks == 1 and c.stats.num_probes == 0


def test_a_noisy_measured_win_does_not_override_the_step_cost_model() -> None:
    """Steps cost 2 ms + 10 ms per row (compute-bound): at 32 requests, drafts of 4 with 3
    accepted give 128 tokens in 1.6 s against 32 in 0.32 s, yet one lucky speculating step
    measured faster than one slow plain step; the controller goes with the model."""
    c = FallbackController(enabled=True, probe_every=8)
    for rows in (32, 160, 64, 100):
        c.observe_step(32, False, 32, 0.002 + 0.010 * rows, rows)
    for _ in range(4):
        c.stats.record_verify(4, 3)
    assert c._predicted_to_pay(32) is False
    c.observe_step(32, True, 128, 0.5)  # measured: 256 tokens / s speculating ...
    c.observe_step(32, False, 32, 0.4)  # ... 80 plain (load from elsewhere)
    assert not c.will_speculate("r", 32) and not c.speculate_batch(32)


def test_fallback_probes_less_often_while_the_decision_holds() -> None:
    c = FallbackController(enabled=True, probe_every=4)
    c.speculate_batch(16)
    c.observe_step(16, True, 20, 0.2)  # 100 tokens/s speculating
    c.speculate_batch(16)
    c.observe_step(16, False, 16, 0.1)  # 160 plain
    probes = [i for i in range(40) if c.speculate_batch(16)]
    assert len(probes) == 3 and probes[1] - probes[0] < probes[2] - probes[1]  # 4, then 8, then 16 steps apart


def test_fallback_learns_step_costs_from_mixed_prompt_and_decode_steps() -> None:
    """Only steps carrying prompt chunks so far (10 ms + 2 ms per decode row + 1 ms per prompt
    row): the cost model is fitted from them, so at 32 the first verify's acceptance (1 of 4)
    already gates speculation off, before any decode-only step was timed."""
    c = FallbackController(enabled=True, probe_every=8)
    for decode, prompt in ((0, 64), (4, 60), (12, 40), (20, 30), (32, 8), (8, 50)):
        c.observe_step(decode, False, decode, 0.010 + 0.002 * decode + 0.001 * prompt, decode, prompt)
    assert c._buckets == {}  # no decode-only step: no bucket measured
    predicted = c._cost.predict(32)
    assert predicted is not None and abs(predicted - 0.074) < 1e-6
    for _ in range(32):
        c.stats.record_verify(4, 1)
    assert not c.speculate_batch(32) and c.stats.num_batch_fallbacks == 1
    assert c.speculate_batch(1)  # 2 tokens in 20 ms beat 1 in 12 at batch 1
    assert abs(c._cost_ratio(32) - (0.010 + 0.002 * 160) / 0.074) < 1e-6


def test_will_speculate_foretells_the_next_step_and_probes_still_come_due() -> None:
    """The runner drafts only where the next step would verify; the peek never changes state, and
    with no drafts anywhere the steps still count, so the probe of speculation comes due."""
    c = FallbackController(enabled=True, probe_every=4)
    c.speculate_batch(8)
    c.observe_step(8, True, 10, 0.2)  # 50 tokens/s speculating
    c.speculate_batch(8)
    c.observe_step(8, False, 8, 0.1)  # 80 plain: speculation off
    decisions = []
    for _ in range(30):
        peek = c.will_speculate("r", 8)
        assert peek == c.will_speculate("r", 8)
        decisions.append(c.speculate_batch(8, has_drafts=peek))
        assert decisions[-1] == peek
    assert 1 <= decisions.count(True) <= 3  # the probes, ever further apart
    c.observe_verify("r", 8, 0)  # poor acceptance at a cost ratio of 2: the request stops drafting
    assert not c.will_speculate("r", 1) and c.will_speculate("other", 1)


def test_step_cost_model_tells_verify_rows_from_decode_rows() -> None:
    """10 ms + 2 ms per decode row, verify rows 1 ms dearer: once steps with and without drafts
    were timed, the model charges a draft row 3 ms; before, it keeps one slope for all rows."""
    c = FallbackController(enabled=True)
    for batch in (2, 8, 4, 16):
        c.observe_step(batch, True, batch, 0.010 + 0.002 * 5 * batch + 0.001 * 4 * batch, 5 * batch, 0, 4 * batch)
    spec = c._cost.predict(5 * 8, 4 * 8)
    assert spec is not None and abs(spec - (0.010 + 0.002 * 40 + 0.001 * 32)) < 2e-3
    for batch in (2, 8, 4, 16):
        c.observe_step(batch, False, batch, 0.010 + 0.002 * batch, batch)
    plain, spec = c._cost.predict(8), c._cost.predict(5 * 8, 4 * 8)
    assert plain is not None and abs(plain - 0.026) < 5e-4
    assert spec is not None and abs(spec - (0.010 + 0.002 * 40 + 0.001 * 32)) < 5e-4


def test_slow_prefill_steps_do_not_take_over_the_decode_step_cost() -> None:
    """Batch 1 on a busy machine (the trace that switched n-gram speculation off): a plain decode
    step 30 ms, a 5-row verify 120 ms, and between requests prefill steps of similar lengths
    whose times are noisy (a 1.4 s "intercept" if fitted with the decode steps' a). The
    prompt steps' own fixed cost keeps the decode predictions where the decode steps put them."""
    c = FallbackController(enabled=True)
    for prompt, seconds in ((135, 1.75), (108, 1.68), (117, 1.85)):
        c.observe_step(0, False, 0, seconds, 0, prompt)
        for i in range(120):
            verify = i % 16 == 0
            c.observe_step(1, verify, 4 if verify else 1, 0.120 if verify else 0.030, 5 if verify else 1, 0,
                           4 if verify else 0)
        plain, spec = c._cost.predict(1), c._cost.predict(5, 4)
        assert plain is not None and abs(plain - 0.030) < 2e-3
        assert spec is not None and abs(spec - 0.120) < 5e-3
    for _ in range(8):
        c.stats.record_verify(4, 3)
    assert c._predicted_to_pay(1) is True


def test_a_step_carrying_a_prompt_chunk_verifies_no_drafts() -> None:
    """With the fallback on, a request's drafts wait while another request's prompt is being
    computed (compute-bound steps: a draft row costs a prompt row); with it off they share the
    step (the test above)."""
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8, max_model_len=256, enable_chunked_prefill=True)
    c = FallbackController(enabled=True)
    s = Scheduler(cfg, KVCacheManager(64, 4), c)
    a = make_req("a", [1, 3, 4], max_tokens=8)
    s.add_request(a)
    step(s, {"a": [5]}, {"a": [6, 7]})
    s.add_request(make_req("b", list(range(100, 120))))
    out = step(s, {"a": [6]}, {"a": [7, 8]})
    assert [(x.request_id, x.draft_token_ids) for x in out.scheduled] == [("a", []), ("b", [])]
    assert c.stats.num_batch_fallbacks == 1 and not c.will_speculate("a", 2)
    while s.requests["b"].num_computed_tokens < 20:  # b's prompt, in chunks
        step(s, {"a": [9], "b": [9]} if s.requests["b"].num_computed_tokens >= 12 else {"a": [9]}, {"a": [7, 8]})
    out = s.schedule()
    assert [x.draft_token_ids for x in out.scheduled] == [[7, 8], []]  # decode-only: verified again


def test_the_step_cost_model_is_fitted_once_per_observed_step() -> None:
    """predict runs for every request every step; the fit (a small solve) only when a step was
    observed since, and gives the same prediction either way."""
    c = FallbackController(enabled=True)
    for rows in (1, 5, 2, 10, 3):
        c.observe_step(1, rows > 3, 1, 0.010 + 0.002 * rows, rows)
    first = c._cost.predict(32)
    assert first == pytest.approx(0.010 + 0.002 * 32, rel=1e-6)
    coef = c._cost._coef
    assert c._cost.predict(32) == first and c._cost._coef is coef  # cached
    c.observe_step(1, False, 1, 0.034, 12)  # on the same line: a new fit, the same prediction
    assert c._cost._coef is None and c._cost.predict(32) == pytest.approx(first, rel=1e-3)
