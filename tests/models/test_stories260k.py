"""stories260K: a real trained model converted from llama2.c, bundled as `stories260k`.

Checks against three outside references: the known greedy story, transformers on
the converted directory, and llama2.c's own tokenizer algorithm (re-stated below)."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from paged_session import greedy
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from treadle.entrypoints.cli import main as cli_main
from treadle.layers.attention import ReferenceBackend
from treadle.loaders import LoadedModel, load_model
from treadle.loaders.resolve import resolve_model

LLAMA2C = Path(__file__).resolve().parents[1] / "data" / "stories260k"  # llama2.c originals
STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."
TEXTS = [
    STORY,
    "Tom said, \"Let's go!\" and ran to the big red ball.",
    "Zoë's café — naïve 日本 🚀\n\nnew  lines\tand  double  spaces",
    "",
]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: a tiny model runs faster on one thread


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return load_model("stories260k", ReferenceBackend())


def llama2c_encode(text: str, pieces: list[bytes], scores: list[float]) -> list[int]:
    """llama2.c's run.c `encode` with BOS: dummy-prefix space, code points looked up
    or spelled as <0xNN> byte tokens (id = byte + 3), then repeatedly merge the
    adjacent pair whose merged piece scores best (leftmost on ties)."""
    vocab = {p: i for i, p in enumerate(pieces)}
    text = " " + text if text else text
    ids: list[int] = []
    for ch in text:
        b = ch.encode()
        ids.extend([vocab[b]] if b in vocab else [byte + 3 for byte in b])
    while True:
        best = None
        for i in range(len(ids) - 1):
            merged = vocab.get(pieces[ids[i]] + pieces[ids[i + 1]])
            if merged is not None and (best is None or scores[merged] > scores[best[1]]):
                best = (i, merged)
        if best is None:
            break
        ids[best[0] : best[0] + 2] = [best[1]]
    return [1, *ids]


def _read_tok512() -> tuple[list[bytes], list[float]]:
    data = (LLAMA2C / "tok512.bin").read_bytes()
    pieces, scores, off = [], [], 4
    for _ in range(512):
        score, n = struct.unpack_from("<fi", data, off)
        pieces.append(data[off + 8 : off + 8 + n])
        scores.append(score)
        off += 8 + n
    return pieces, scores


def test_greedy_from_bos_tells_the_known_story(lm: LoadedModel) -> None:
    [out] = greedy(lm, [[lm.tokenizer.bos_token_id]], 32)
    assert lm.tokenizer.decode(out).startswith(STORY)


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(resolve_model("stories260k"), dtype=torch.float32).eval()


def _hf_greedy(hf: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():  # generation_config.json: eos_token_id [2, 1]
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def test_greedy_matches_transformers(lm: LoadedModel, hf_model: torch.nn.Module) -> None:
    prompts = [[1], lm.tokenizer.encode("Tom had a red ball."), lm.tokenizer.encode("One day, a cat")]
    ours = greedy(lm, prompts, 48, stop_ids=lm.config.stop_token_ids)
    for prompt, got in zip(prompts, ours):
        assert len(got) == 48
        assert got == _hf_greedy(hf_model, prompt, 48)


def test_generation_stops_on_bos_like_llama2c(lm: LoadedModel, hf_model: torch.nn.Module) -> None:
    """The model ends a story with BOS, not EOS; both stop there."""
    assert lm.config.stop_token_ids == (2, 1) and set(lm.tokenizer.eos_token_ids) == {1, 2}
    prompt = lm.tokenizer.encode("The sun")
    [got] = greedy(lm, [prompt], 240, stop_ids=lm.config.stop_token_ids)
    assert got[-1] == 1 and len(got) < 240  # this story ends after 223 tokens
    assert got == _hf_greedy(hf_model, prompt, 240)


def test_tokenizer_matches_llama2c_and_transformers(lm: LoadedModel) -> None:
    pieces, scores = _read_tok512()
    hf_tok = AutoTokenizer.from_pretrained(resolve_model("stories260k"))
    for text in TEXTS:
        ids = lm.tokenizer.encode(text)
        assert ids == llama2c_encode(text, pieces, scores), text
        assert ids == hf_tok(text).input_ids, text
        assert lm.tokenizer.decode(ids) == text
        assert lm.tokenizer.encode(text, add_special_tokens=False) == ids[1:]
    assert lm.tokenizer.vocab_size == 512
    assert {0, 1, 2} <= lm.tokenizer.all_special_ids
    assert lm.tokenizer.chat_template is None


def test_convert_cli_reproduces_bundled_directory(tmp_path: Path) -> None:
    out = tmp_path / "converted"
    args = ["convert", "--llama2c", str(LLAMA2C / "stories260K.bin"), "--tokenizer", str(LLAMA2C / "tok512.bin"), str(out)]
    assert cli_main(args) == 0
    bundled = resolve_model("stories260k")
    for name in ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json"):
        assert json.loads((out / name).read_text()) == json.loads((bundled / name).read_text()), name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2, 1]
    ours, committed = load_file(out / "model.safetensors"), load_file(bundled / "model.safetensors")
    assert ours.keys() == committed.keys() and len(ours) == 2 + 9 * 5  # embed, final norm, 9 per layer
    for name, tensor in ours.items():
        assert torch.equal(tensor, committed[name]), name


def test_convert_rejects_a_truncated_checkpoint(tmp_path: Path) -> None:
    bad = tmp_path / "short.bin"
    bad.write_bytes((LLAMA2C / "stories260K.bin").read_bytes()[:5000])
    from treadle.config import TreadleError
    from treadle.loaders.llama2c import convert_llama2c

    with pytest.raises(TreadleError, match=r"short\.bin: 5000 bytes, but its header implies 1056540"):
        convert_llama2c(bad, LLAMA2C / "tok512.bin", tmp_path / "out")
