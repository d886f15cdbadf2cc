"""Gemma 3 270M (Q4_K_M GGUF, the `gemma-3-270m` short name) against transformers loading the
same file dequantized: greedy tokens identical, over short prompts and one longer than the
512-token sliding window. And Treadle's native GGUF path (quantized weights multiplied by the
C kernels, the 262k-row lm_head included) against the dequantized model, teacher-forced.

Loading the file twice and transformers once takes about a minute on 2 cores: slow."""
from __future__ import annotations

import pytest
import torch
from gguf_files import fast_gguf_parsing
from paged_session import PagedSession

from treadle.layers.attention.cpu import CPUBackend
from treadle.loaders import LoadedModel, load_model, open_model_source
from treadle.loaders.resolve import resolve_model

pytestmark = pytest.mark.slow  # both cores: a 270M model with a 262k-row lm_head, in float32

TEXTS = ["The capital of France is", "Once upon a time, there was a little", "def fibonacci(n):"]
NEW_TOKENS = 16


@torch.no_grad()
def greedy_last_rows(lm: LoadedModel, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy tokens of a batch of prompts decoded together through the paged cache, taking logits
    of each sequence's last row only at each step (the prompts' other rows over a 262k vocabulary
    would cost more than the model; one step serves every prompt, as the engine batches them)."""
    session = PagedSession(lm, len(prompts), max(map(len, prompts)) + n, block_size=16)
    new, outs = prompts, [[] for _ in prompts]
    for _ in range(n):
        query_lens = [len(t) for t in new]
        seq_lens = [done + q for done, q in zip(session.lens, query_lens)]
        positions, meta = session.inputs.build(query_lens, seq_lens, session.tables)
        meta.plan = lm.model.backend.plan(meta)
        hidden = lm.model(torch.tensor([t for toks in new for t in toks]), positions, session.caches, meta)
        session.lens = seq_lens
        last = torch.tensor(query_lens).cumsum(0) - 1
        new = [[int(i)] for i in lm.model.compute_logits(hidden[last]).argmax(-1)]
        for out, token in zip(outs, new):
            out += token
    return outs


@pytest.fixture(scope="module")
def float_lm() -> LoadedModel:
    return load_model("gemma-3-270m", CPUBackend(), quantization=None)


@pytest.fixture(scope="module")
def prompts(float_lm: LoadedModel) -> list[list[int]]:
    tok = float_lm.tokenizer
    assert tok is not None
    story = tok.encode(" The old lighthouse keeper counted the ships that passed each night, and wrote"
                       " their names in a book that nobody else ever read.", add_special_tokens=False)
    long = tok.encode("Repeat the story.") + story * (560 // len(story) + 1)  # past the 512-token window
    return [tok.encode(t) for t in TEXTS] + [long]


@pytest.fixture(scope="module")
def greedy_tokens(float_lm: LoadedModel, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's NEW_TOKENS greedy tokens from the dequantized model (read-only: both tests below use them)."""
    return greedy_last_rows(float_lm, prompts, NEW_TOKENS)


def test_config_and_tokenizer_from_the_file(float_lm: LoadedModel) -> None:
    cfg, tok = float_lm.config, float_lm.tokenizer
    assert cfg.architecture == "Gemma3ForCausalLM" and (cfg.head_dim, cfg.num_kv_heads, cfg.vocab_size) == (256, 1, 262144)
    assert [i for i in range(cfg.num_layers) if cfg.layer_window(i) is None] == [5, 11, 17]
    assert cfg.sliding_window == 512 and (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
    assert tok is not None and tok.encode("Hello")[0] == cfg.bos_token_id == 2
    assert 106 in cfg.stop_token_ids  # <end_of_turn>
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True)
    assert ids[:2] == [2, 105] and ids.count(2) == 1 and ids.count(106) == 1  # <bos>, turn markers as single ids


def test_dequantized_greedy_matches_transformers(prompts: list[list[int]], greedy_tokens: list[list[int]]) -> None:
    """Transformers' greedy tokens, read off one causal forward over prompt + our tokens (teacher
    forcing): its argmax after prompt + got[:i] must be got[i] for every i, which holds exactly
    when its own greedy decoding would give got (and costs one pass, not a generate loop)."""
    from transformers import AutoModelForCausalLM

    path = resolve_model("gemma-3-270m")
    with fast_gguf_parsing():
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    for prompt, got in zip(prompts, greedy_tokens):
        with torch.no_grad():  # logits of the last NEW_TOKENS positions only (the 262k-row lm_head)
            logits = hf(torch.tensor([prompt + got[:-1]]), logits_to_keep=NEW_TOKENS).logits[0]
        assert got == logits.argmax(-1).tolist()


def test_native_gguf_path_close_to_dequantized(float_lm: LoadedModel, prompts: list[list[int]],
                                               greedy_tokens: list[list[int]]) -> None:
    """Teacher-forced on the dequantized model's greedy tokens (the short prompts): the quantized path (activations
    rounded to 16 bits per block inside the kernels) picks the same token wherever the
    dequantized model's top two are 0.1 logit apart or more, and its log-probabilities of the
    chosen tokens are within 0.02 on average."""
    # token ids only: no second build of the file's 262k-piece tokenizer (~3 s; float_lm has it)
    native = load_model(open_model_source("gemma-3-270m", skip_tokenizer_init=True), CPUBackend(), quantization="gguf")
    assert type(native.model.embed_tokens.method).__name__ == "GGUFBlockMethod"  # the tied lm_head stays Q8_0
    seqs = [p + g for p, g in zip(prompts[:len(TEXTS)], greedy_tokens)]
    diffs = []
    for seq in seqs:
        logits = []
        for lm in (float_lm, native):
            session = PagedSession(lm, 1, len(seq), block_size=16)
            logits.append(session.feed([seq[:-1]])[0][-NEW_TOKENS:].log_softmax(-1))
        ref, got = logits
        top2 = ref.topk(2, dim=-1).values
        decided = (top2[:, 0] - top2[:, 1]) >= 0.1
        assert torch.equal(got.argmax(-1)[decided], ref.argmax(-1)[decided])
        chosen = torch.tensor(seq[-NEW_TOKENS:])[:, None]
        diffs.append((got.gather(1, chosen) - ref.gather(1, chosen)).abs().mean())
    assert float(torch.stack(diffs).mean()) <= 0.02
