"""Llama-family models loaded by treadle from Hugging Face directories agree with
transformers on the same weights: logits (float32, within 1e-4) through the paged
cache, and greedy continuations token for token.

Tiny random models of each variant are made with transformers and saved with
save_pretrained; a word-level tokenizer is saved beside them (the loader needs one).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from paged_session import PagedSession, greedy
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

from treadle import LLM, SamplingParams
from treadle.layers.attention import ReferenceBackend
from treadle.loaders import load_model

VOCAB = 96
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=128, initializer_range=0.1, eos_token_id=None, bos_token_id=None,
)
VARIANTS = {
    "llama-mha": LlamaConfig(**_COMMON, num_key_value_heads=4),
    "llama-gqa-tied": LlamaConfig(**_COMMON, num_key_value_heads=2, tie_word_embeddings=True),
    "llama-mqa": LlamaConfig(**_COMMON, num_key_value_heads=1),
    "llama-rope-linear": LlamaConfig(
        **_COMMON, num_key_value_heads=2, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    ),
    "llama-rope-llama3": LlamaConfig(
        **_COMMON, num_key_value_heads=2, tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32, "rope_theta": 500000.0,
        },
    ),
    "mistral-sliding-8": MistralConfig(**_COMMON, num_key_value_heads=2, sliding_window=8),
    "qwen2-qkv-bias": Qwen2Config(**_COMMON, num_key_value_heads=2),
    # per-head q/k RMSNorm before RoPE; head_dim 32 while hidden / heads is 16
    "qwen3-qk-norm": Qwen3Config(**_COMMON, num_key_value_heads=2, head_dim=32),
    # q/k/v and gate/up stacked in the checkpoint itself
    "phi3-packed": Phi3Config(**_COMMON, num_key_value_heads=2, pad_token_id=None),
}
PROMPT_LENS = (1, 7, 19)
NEW_TOKENS = 32


pytestmark = pytest.mark.usefixtures("one_thread")


def _save_tokenizer(path: Path) -> None:
    words = {f"w{i}": i for i in range(VOCAB)}
    tok = BackendTokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"unk_token": "w0"}))


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(transformers model, treadle LoadedModel) over the same saved weights."""
    torch.manual_seed(sum(map(ord, request.param)))
    config = VARIANTS[request.param]
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    _save_tokenizer(path)
    return hf, load_model(str(path), ReferenceBackend())


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def test_config_read_from_directory(pair) -> None:
    hf, lm = pair
    cfg = lm.config
    assert cfg.architecture == hf.config.architectures[0]
    assert (cfg.num_heads, cfg.num_kv_heads) == (hf.config.num_attention_heads, hf.config.num_key_value_heads)
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    assert cfg.qkv_bias == (cfg.architecture == "Qwen2ForCausalLM")
    assert cfg.head_dim == (getattr(hf.config, "head_dim", None) or hf.config.hidden_size // hf.config.num_attention_heads)
    assert cfg.sliding_window == (8 if cfg.architecture == "MistralForCausalLM" else None)


def test_logits_match_transformers_through_paged_cache(pair) -> None:
    """Prefill a batch of prompts of different lengths, then decode teacher-forced
    tokens one at a time; every position's logits match transformers' full forward."""
    hf, lm = pair
    prompts = _prompts(1)
    continuations = _prompts(2)[2][:12]  # 12 tokens, the same for each sequence
    session = PagedSession(lm, len(prompts), max(PROMPT_LENS) + len(continuations))
    ours = [[row] for row in session.feed(prompts)]
    for tok in continuations:
        for acc, row in zip(ours, session.feed([[tok]] * len(prompts))):
            acc.append(row)
    for prompt, acc in zip(prompts, ours):
        full = torch.tensor([prompt + continuations])
        with torch.no_grad():
            expected = hf(full).logits[0]
        got = torch.cat(acc)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
        # the model is not degenerate: positions differ and logits are not all alike
        assert expected.std() > 0.1


def test_greedy_continuations_match_generate(pair) -> None:
    hf, lm = pair
    prompts = _prompts(3)
    ours = greedy(lm, prompts, NEW_TOKENS)
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            ids = torch.tensor([prompt])
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )
        expected = out[0, len(prompt) :].tolist()
        assert len(expected) == NEW_TOKENS
        assert got == expected


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_engine_greedy_and_logprobs_match_transformers(pair, backend: str) -> None:
    """Through the engine (scheduler, runner, paged cache): greedy tokens identical,
    logprobs of the chosen tokens close to transformers' full forward."""
    hf, lm = pair
    llm = LLM(str(lm.path), attention_backend=backend, num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1, ignore_eos=True)
    prompts = _prompts(4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        got = out.outputs[0].token_ids
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + got])).logits[0].log_softmax(-1)
        assert got == ref[len(prompt) - 1 : -1].argmax(-1).tolist()
        for i, (tok, lp) in enumerate(zip(got, out.outputs[0].logprobs)):
            assert abs(lp[tok].logprob - float(ref[len(prompt) - 1 + i, tok])) < 1e-4
