"""Unit tests: incremental detokenization, stop strings, and the sampler."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from treadle.engine.detokenizer import IncrementalDetokenizer
from treadle.sample import sampler as sampler_mod
from treadle.sample.sampler import Sampler, SamplingRow, apply_penalties, filter_logits
from treadle.sampling_params import SamplingParams, SamplingParamsError
from treadle.tokenizer import Tokenizer

TEXT = "héllo wörld — 日本語 🌍🎉 done"


@pytest.fixture(scope="module")
def byte_tokenizer(tiny_llama) -> Tokenizer:
    return Tokenizer.from_hf_dir(tiny_llama)


def stream(tok: Tokenizer, ids: list[int], params: SamplingParams) -> tuple[list[str], str | None, str]:
    detok = IncrementalDetokenizer(tok, [0], params)
    deltas, stop = [], None
    for t in ids:
        stop = detok.add_token(t)
        deltas.append(detok.take_delta(stop is not None))
        if stop is not None:
            break
    else:
        deltas.append(detok.take_delta(True))
    return deltas, stop, detok.text


def test_utf8_split_across_byte_tokens(byte_tokenizer):
    ids = byte_tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) == len(TEXT.encode())  # one token per byte: characters are split
    deltas, stop, text = stream(byte_tokenizer, ids, SamplingParams())
    assert stop is None and text == TEXT and "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("stop", ["wörld", "本語 🌍", "o w", "done"])
def test_stop_string_across_tokens_not_in_text(byte_tokenizer, stop):
    ids = byte_tokenizer.encode(TEXT, add_special_tokens=False)
    deltas, hit, text = stream(byte_tokenizer, ids, SamplingParams(stop=[stop, "never"]))
    assert hit == stop
    assert text == TEXT[: TEXT.index(stop)]
    assert "".join(deltas) == text  # nothing past the stop was ever streamed


def test_earliest_stop_wins(byte_tokenizer):
    ids = byte_tokenizer.encode("abcdef", add_special_tokens=False)
    _, hit, text = stream(byte_tokenizer, ids, SamplingParams(stop=["def", "cd"]))
    assert hit == "cd" and text == "ab"


def row(params: SamplingParams, out=(), prompt=(1, 2)) -> SamplingRow:
    return SamplingRow(params, list(prompt), list(out), (0,))


def test_seeded_sampling_independent_of_batch():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = Sampler(seed=1)([logits[2:3]][0], [row(seeded)])[0]
    batch_rows = [row(SamplingParams(temperature=0.8)), row(SamplingParams(temperature=0)), row(seeded),
                  row(SamplingParams(temperature=1.5, top_k=5)), row(SamplingParams(temperature=1.0, seed=7))]
    batched = Sampler(seed=99)(logits, batch_rows)[0]
    assert batched[2] == alone[0]
    assert batched[1] == int(logits[1].argmax())


def test_seeded_sampling_follows_distribution():
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0])
    counts = torch.zeros(4)
    sampler = Sampler()
    for i in range(3000):
        tok = sampler(logits[None], [row(SamplingParams(temperature=1.0, seed=i))])[0][0]
        counts[tok] += 1
    assert torch.allclose(counts / 3000, logits.softmax(-1), atol=0.03)


def test_top_k_top_p_min_p_filters():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isinf(filter_logits(logits, SamplingParams(top_k=2))[2:]).all()
    kept = ~torch.isinf(filter_logits(logits, SamplingParams(top_p=0.7)))
    assert kept.tolist() == [True, True, False, False]
    kept = ~torch.isinf(filter_logits(logits, SamplingParams(min_p=0.25)))
    assert kept.tolist() == [True, True, True, False]


def test_penalties():
    logits = torch.tensor([2.0, -2.0, 1.0, 1.0])
    r = row(SamplingParams(repetition_penalty=2.0), out=[2], prompt=[1])
    assert apply_penalties(logits, r).tolist() == [2.0, -4.0, 0.5, 1.0]
    r = row(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), out=[2, 2, 3], prompt=[0])
    assert apply_penalties(logits, r).tolist() == [2.0, -2.0, 1.0 - 1.0 - 0.25, 1.0 - 0.5 - 0.25]


def test_min_tokens_masks_stop_tokens():
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    p = SamplingParams(temperature=0.0, min_tokens=2)
    assert Sampler()(logits, [row(p, out=[1])])[0] == [1]
    assert Sampler()(logits, [row(p, out=[1, 1])])[0] == [0]


@pytest.mark.parametrize("kw,param", [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
                                      (dict(n=0), "n"), (dict(max_tokens=0), "max_tokens"),
                                      (dict(logprobs=21), "logprobs"), (dict(top_p=1.5), "top_p"),
                                      (dict(repetition_penalty=1e-300), "repetition_penalty"),
                                      (dict(seed=2**64), "seed"), (dict(top_k=-(2**63) - 1), "top_k"),
                                      (dict(stop=5), "stop"), (dict(stop_token_ids=7), "stop_token_ids"),
                                      (dict(stop_token_ids=[2**63]), "stop_token_ids")])
def test_sampling_params_validation(kw, param):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kw)
    assert e.value.param == param


def sorted_top_p(probs: torch.Tensor, top_p: float) -> set[int]:
    """top-p by its definition: a stable sort of all of probs, highest first."""
    values, order = torch.sort(probs, descending=True, stable=True)
    return set(order[~(values.cumsum(-1) - values > top_p)].tolist())


@pytest.mark.parametrize("case", range(30))
@pytest.mark.parametrize("candidates", [sampler_mod.TOP_P_CANDIDATES, 8])
def test_top_p_keeps_what_a_full_sort_keeps(case: int, candidates: int, monkeypatch) -> None:
    """Peaked to flat rows, rows with many ties (rounded logits), every top_p; with 8
    candidates most rows take the sorted-values path."""
    monkeypatch.setattr(sampler_mod, "TOP_P_CANDIDATES", candidates)
    g = torch.Generator().manual_seed(case)
    logits = torch.randn(49152 if case % 4 == 0 else 3000, generator=g) * (0.3 + 2 * (case % 5))
    if case % 3 == 0:
        logits = logits.round()
    probs = logits.softmax(-1)
    top_p = (0.05, 0.5, 0.9, 0.95, 0.999)[case % 5]
    assert set(sampler_mod.top_p_keep(probs, top_p).tolist()) == sorted_top_p(probs, top_p)


def test_draw_follows_an_unnormalised_distribution_and_never_draws_zeros() -> None:
    probs = torch.tensor([0.0, 2.0, 0.0, 1.0, 1.0, 0.0])  # total 4
    sampler, counts = Sampler(seed=3), torch.zeros(6)
    for i in range(4000):
        counts[sampler.draw(probs, row(SamplingParams(temperature=1.0, seed=i)))] += 1
    assert counts[[0, 2, 5]].sum() == 0
    assert torch.allclose(counts / 4000, probs / 4, atol=0.03)


def dense_penalties(logits: torch.Tensor, r: SamplingRow) -> torch.Tensor:
    """The penalties over the whole vocabulary, as written in their definitions."""
    p, vocab = r.params, logits.shape[0]
    counts = torch.bincount(torch.tensor(r.output_token_ids), minlength=vocab).to(logits.dtype)
    seen = counts > 0
    seen[torch.tensor(r.prompt_token_ids)] = True
    logits = torch.where(seen, torch.where(logits > 0, logits / p.repetition_penalty,
                                           logits * p.repetition_penalty), logits)
    return logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(logits.dtype)


@pytest.mark.parametrize("seed", range(5))
def test_sparse_penalties_equal_the_dense_definition(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(5000, generator=g) * 4
    prompt, out = torch.randint(0, 5000, (300,), generator=g).tolist(), torch.randint(0, 400, (90,), generator=g).tolist()
    r = row(SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.2), out=out, prompt=prompt)
    assert torch.equal(apply_penalties(logits, r), dense_penalties(logits, r))


def test_sampling_among_the_kept_tokens_matches_the_masked_distribution() -> None:
    """A row with top-k / top-p / min-p draws among the kept tokens only; each token's
    frequency is its probability under filter_logits (the verifier's p)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, generator=g) * 2
    params = SamplingParams(temperature=0.9, top_k=12, top_p=0.8, min_p=0.05, seed=0)
    p = filter_logits(logits, params).softmax(-1)
    sampler, counts = Sampler(seed=5), torch.zeros(40)
    for i in range(6000):
        counts[sampler(logits[None], [row(dataclasses.replace(params, seed=i))])[0][0]] += 1
    assert counts[p == 0].sum() == 0
    assert (counts / 6000 - p).abs().max() < 0.025


def test_a_row_with_nothing_to_draw_gets_a_token_not_an_error() -> None:
    nan = torch.full((1, 8), float("nan"))
    assert 0 <= Sampler()(nan, [row(SamplingParams(temperature=1.0, top_p=0.9, seed=1))])[0][0] < 8


def test_a_temperature_too_small_to_divide_by_samples_greedily() -> None:
    """logits / 1e-300 would be inf and the softmax NaN: below 1e-5 a row is greedy (as vLLM)."""
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9]])
    for t in (1e-300, 1e-6):
        p = SamplingParams(temperature=t, seed=3)
        assert p.greedy and Sampler()(logits, [row(p)])[0] == [1]
    assert not SamplingParams(temperature=1e-5).greedy
