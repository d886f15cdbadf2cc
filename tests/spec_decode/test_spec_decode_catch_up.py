"""Lazy catch-up of a KV-owning proposer (``spec_decode/proposer.py``: ``CatchUp``): the EAGLE
head runs no rows for a request while it does not draft, and when it drafts again its one
catch-up forward leaves the head's KV and drafts what an always-drafting head has.

Two EagleProposers (stories260k and its shipped head, separate KV and hidden caches over the
same block ids) see the same target steps, built from the target's real hidden states over a
real greedy continuation: "on" drafts for both requests every step; "lazy" drafts for request
a every step and for request b only from the probe step on."""
from __future__ import annotations

import pytest
import torch

from treadle import LLM, SamplingParams
from treadle.config import CacheConfig, SpeculativeConfig
from treadle.layers.attention import StepInputBuilder
from treadle.layers.attention.selector import select_backend
from treadle.loaders import load_model
from treadle.loaders.resolve import resolve_model
from treadle.models.llama import LlamaForCausalLM
from treadle.spec_decode.draft_model import DraftModelProposer
from treadle.spec_decode.head_proposers import EagleProposer
from treadle.spec_decode.proposer import CatchUp, ProposerStep, RequestProgress
from treadle.worker.model_runner import allocate_kv_cache
from treadle.worker.proposers import build_proposer

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK, NUM_BLOCKS = 4, 48
PROMPTS = ["Once upon a time, there was a little girl named Lily.", "Tom had a big red ball. He"]
BLOCKS = {"a": list(range(0, 40, 2)), "b": list(range(41, 1, -2))}  # scattered, disjoint
NEW_TOKENS = 24
PROBE = 12  # b's decode steps without drafts before it drafts again


def _sequences() -> dict[str, list[int]]:
    """Each prompt and the target's greedy continuation (the tokens the steps will carry)."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = LLM("stories260k").generate(PROMPTS, params, use_tqdm=False)
    return {rid: list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for rid, o in zip("ab", outs)}


def _hidden(target: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:  # [T, H]
    """The target's final hidden states over ``tokens``, one prefill in a cache of its own."""
    kv = allocate_kv_cache(target.config, 16, 16, torch.float32, "cpu")
    positions, meta = StepInputBuilder(16).build([len(tokens)], [len(tokens)], [list(range(16))])
    meta.plan = target.backend.plan(meta)
    with torch.inference_mode():
        return target(torch.tensor(tokens), positions, kv, meta)


def _proposer(target: LlamaForCausalLM) -> EagleProposer:
    head = resolve_model("stories260k") / "draft-heads" / "eagle"
    spec = SpeculativeConfig("eagle", 4, 2, 4, fallback=False, model=str(head))
    cache = CacheConfig(BLOCK, NUM_BLOCKS, 0, False, "float32")
    proposer = build_proposer(spec, target, [], cache, torch.device("cpu"), fused_layers=False)
    assert isinstance(proposer, EagleProposer)
    return proposer


def _steps(seqs: dict[str, list[int]], hidden: dict[str, torch.Tensor], prompt_lens: dict[str, int],
           b_drafts_from: int) -> list[ProposerStep]:
    """Step 0: both prompts; step i >= 1: one decode row each. b wants drafts from step
    ``b_drafts_from`` on (and on step 0 when that is 0); a always."""
    steps = []
    for i in range(NEW_TOKENS - 1):
        requests, rows, cursor = [], [], 0
        for rid in "ab":
            start = 0 if i == 0 else prompt_lens[rid] + i - 1
            n = prompt_lens[rid] if i == 0 else 1
            wants = rid == "a" or i >= b_drafts_from
            requests.append(RequestProgress(rid, seqs[rid][: start + n + 1], BLOCKS[rid], start, n, cursor, wants,
                                            len(BLOCKS[rid]) * BLOCK))
            rows.append(hidden[rid][start : start + n])
            cursor += n
        steps.append(ProposerStep(requests, torch.cat(rows)))
    return steps


def _head_kv(p: EagleProposer, blocks: list[int], end: int) -> torch.Tensor:  # [2, end, kv heads, dim]
    k, v = p.kv_cache
    slots = torch.tensor([blocks[j // BLOCK] * BLOCK + j % BLOCK for j in range(end)])
    return torch.stack([k.flatten(0, 1)[slots], v.flatten(0, 1)[slots]])


def test_head_catches_up_lazily_to_what_an_always_on_head_has() -> None:
    target = load_model("stories260k", select_backend("reference", torch.device("cpu")))
    seqs = _sequences()
    prompt_lens = {rid: len(seqs[rid]) - NEW_TOKENS for rid in "ab"}
    hidden = {rid: _hidden(target.model, seqs[rid]) for rid in "ab"}
    on, lazy = _proposer(target.model), _proposer(target.model)
    on_steps, hits = _steps(seqs, hidden, prompt_lens, 0), 0
    lazy_steps = _steps(seqs, hidden, prompt_lens, PROBE)
    for i, (on_step, lazy_step) in enumerate(zip(on_steps, lazy_steps)):
        want = on.propose(on_step)
        before = (lazy.work.forwards, lazy.work.rows)
        got = lazy.propose(lazy_step)
        forwards, rows = lazy.work.forwards - before[0], lazy.work.rows - before[1]
        a_rows = (prompt_lens["a"] if i == 0 else 1) + len(got["a"]) - 1  # catch-up + chain rows
        assert got["a"] == want["a"]
        if i < PROBE:  # b does not draft: the head runs a's rows only
            assert "b" not in got
            assert rows == a_rows and forwards == len(got["a"])
            continue
        b_end = len(lazy_step.requests[1].token_ids) - 1
        if i == PROBE:  # one flat catch-up over b's prompt and its PROBE missed decodes, beside a's row
            assert rows == a_rows + b_end + len(got["b"]) - 1
            assert forwards == max(len(got["a"]), len(got["b"]))
        assert got["b"] == want["b"]
        hits += want["b"][0] == seqs["b"][b_end + 1]  # d1 is the token after x (at b_end)
        torch.testing.assert_close(_head_kv(lazy, BLOCKS["b"], b_end), _head_kv(on, BLOCKS["b"], b_end),
                                   atol=1e-5, rtol=1e-5)
    # the head's first drafts often are the target's next token: not a comparison of noise
    assert hits >= (NEW_TOKENS - 1 - PROBE) // 3
    assert lazy.work.rows < on.work.rows


def test_draft_model_runs_no_rows_for_a_request_that_does_not_draft() -> None:
    """The same lazy catch-up in the draft-model proposer (stories260k drafting for itself, KV
    of its own): b costs no rows until it drafts, then its drafts equal an always-on draft's."""
    target = load_model("stories260k", select_backend("reference", torch.device("cpu")))
    seqs = _sequences()
    prompt_lens = {rid: len(seqs[rid]) - NEW_TOKENS for rid in "ab"}
    hidden = {rid: _hidden(target.model, seqs[rid]) for rid in "ab"}

    def draft() -> DraftModelProposer:
        kv = allocate_kv_cache(target.config, NUM_BLOCKS, BLOCK, torch.float32, "cpu")
        return DraftModelProposer(4, target.model, kv, target.model.backend, BLOCK, 512, False)

    on, lazy = draft(), draft()
    for i, (on_step, lazy_step) in enumerate(zip(_steps(seqs, hidden, prompt_lens, 0),
                                                 _steps(seqs, hidden, prompt_lens, PROBE))):
        want = on.propose(on_step)
        rows = lazy.work.rows
        got = lazy.propose(lazy_step)
        a_rows = (prompt_lens["a"] + 1 if i == 0 else 2) + len(got["a"]) - 1  # catch-up (x too) + chain
        if i < PROBE:
            assert "b" not in got and lazy.work.rows - rows == a_rows
        else:
            assert got["b"] == want["b"]
        assert got["a"] == want["a"]
    assert lazy.work.rows < on.work.rows


def test_catch_up_resets_on_recompute_and_new_requests() -> None:
    """Torch-free bookkeeping: valid advances only by ``caught_up``; a step whose start is below
    the computed length last seen (preemption) sends it back to 0; a forgotten id starts at 0."""
    c = CatchUp()

    def step(start: int, n: int) -> int:
        return c.valid(RequestProgress("r", list(range(start + n + 1)), [0], start, n, 0, True, 64))

    assert step(0, 10) == 0
    c.caught_up("r", 10)
    assert step(10, 1) == 10 and step(11, 1) == 10  # no catch-up on step 11: still 10
    c.caught_up("r", 12)
    assert step(12, 3) == 12
    assert step(8, 4) == 0  # recomputed from 8 (a prefix hit below): nothing below is trusted
    c.caught_up("r", 12)
    c.forget(["r"])
    assert step(12, 1) == 0


def test_eagle_with_preemption_and_prefix_hits_greedy_identical() -> None:
    """Engine level, the shipped head, fallback off: preemption (recompute) and prefix hits
    (a catch-up over the hit) leave greedy output as without speculation."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = PROMPTS + [PROMPTS[0] + " She liked", PROMPTS[1] + " said"]
    kw: dict[str, object] = dict(num_kv_blocks=20, block_size=4, max_num_batched_tokens=32)
    plain = LLM("stories260k", **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM("stories260k", speculative_config={"method": "eagle", "num_speculative_tokens": 4, "fallback": False},
              **kw)
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    stats = llm.get_stats()
    assert stats["preemptions"] > 0 and stats["spec_decode"]["accepted_tokens"] > 0
    assert any(o.metrics.num_cached_tokens > 0 for o in out)
