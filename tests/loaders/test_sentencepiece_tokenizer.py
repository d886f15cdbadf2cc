"""An HF directory with only tokenizer.model (SentencePiece BPE, Llama-2 / Mistral style):
tokenized as SentencePiece itself does (the library transformers' slow LlamaTokenizer wraps),
from a tiny model trained at test time. (transformers 5 here cannot convert a bare
tokenizer.model without protobuf, so it is not the oracle for this file.)"""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import sentencepiece as spm

from treadle.config import TreadleError
from treadle.tokenizer import Tokenizer

TEXTS = ["Hello world", "the quick brown fox", "  two  spaces", "café naïve", "日本語 and emoji 🦊",
         "line\nbreak\ttab", "zebras 123 456", ""]


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sp")
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog seven wizards hex jolly zebras 123 café naïve".split()
    corpus = out / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(500)))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(out / "tokenizer"), vocab_size=320,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   minloglevel=2)  # as Llama-2's and Mistral's tokenizer.model
    corpus.unlink()
    (out / "tokenizer.vocab").unlink()
    return out


def test_tokenizer_model_matches_sentencepiece(sp_dir: Path) -> None:
    tok = Tokenizer.from_hf_dir(sp_dir)
    sp = spm.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    assert tok.vocab_size == sp.get_piece_size()
    assert tok.bos_token == "<s>" and tok.eos_token_ids == (sp.eos_id(),)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text), text
        assert tok.encode(text) == [sp.bos_id(), *ids]  # LlamaTokenizer adds BOS by default
        assert tok.decode(ids) == sp.decode(ids), text


def test_no_tokenizer_says_both_ways_out(tmp_path: Path) -> None:
    with pytest.raises(TreadleError, match="tokenizer.model.*skip_tokenizer_init"):
        Tokenizer.from_hf_dir(tmp_path)


def test_unigram_model_is_refused(tmp_path: Path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(["hello world again and again"] * 50))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "tokenizer"), vocab_size=15,
                                   model_type="unigram", minloglevel=2)
    with pytest.raises(TreadleError, match="only BPE"):
        Tokenizer.from_hf_dir(tmp_path)
