"""A tiny Llama GGUF whose weights are K-quant and Q5_0/Q5_1 blocks in a llama.cpp-style mix
(fused q/k/v and gate/up shards of different types), run natively against transformers
loading the same file (``gguf_file=``) and against Treadle's own dequantized path.

The blocks are random bytes with bounded scales (tests/gguf_files.py): every field of every
layout is exercised, and the gguf package dequantizes them for both references. Tolerance:
the native kernels round activations to 16 bits per block of 32 (relative 2^-16 of a block's
largest value), so logits differ from the float references by ~1e-5 of their range; greedy
tokens must be identical.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf_files import finish, gguf_name, random_blocks, write_llama_metadata
from kernel_variants import force
from paged_session import PagedSession, greedy
from transformers import AutoModelForCausalLM, LlamaConfig

from treadle.kernels import native
from treadle.layers.attention.cpu import CPUBackend
from treadle.layers.linear import Linear
from treadle.loaders import LoadedModel, load_model
from treadle.quantization.methods.gguf_native import GGUFBlockMethod
from treadle.worker.fused_layers import fuse_decoder_layers

pytestmark = [
    pytest.mark.usefixtures("one_thread", "sixteen_bit_activations"),
    pytest.mark.skipif(not native.available(), reason="needs a C compiler (Treadle's CPU kernels)"),
]

CONFIG = LlamaConfig(
    vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
)
# every type the kernels read, in mixes like llama.cpp's (attn_v and ffn_down with more bits)
TYPES = {
    "model.embed_tokens.weight": "Q4_K",
    "lm_head.weight": "Q6_K",
    **{f"model.layers.0.{k}.weight": t for k, t in {
        "self_attn.q_proj": "Q4_K", "self_attn.k_proj": "Q4_K", "self_attn.v_proj": "Q6_K",
        "self_attn.o_proj": "Q5_K", "mlp.gate_proj": "Q2_K", "mlp.up_proj": "Q2_K", "mlp.down_proj": "Q3_K",
    }.items()},
    **{f"model.layers.1.{k}.weight": t for k, t in {
        "self_attn.q_proj": "Q5_0", "self_attn.k_proj": "Q5_0", "self_attn.v_proj": "Q8_0",
        "self_attn.o_proj": "Q5_1", "mlp.gate_proj": "Q4_K", "mlp.up_proj": "Q5_K", "mlp.down_proj": "Q6_K",
    }.items()},
}
PROMPTS = [[1, 300, 42, 7, 9, 100, 3, 11], [1, 5, 77, 200, 13]]


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    shapes = {name: tuple(t.shape) for name, t in AutoModelForCausalLM.from_config(CONFIG).state_dict().items()}
    path = tmp_path_factory.mktemp("kquant") / "m.gguf"
    w = GGUFWriter(path, "llama")
    write_llama_metadata(w, CONFIG)
    rng = np.random.default_rng(7)
    for i, (name, shape) in enumerate(shapes.items()):
        if len(shape) == 2:
            b = random_blocks(TYPES[name], shape[0], shape[1], seed=i)
            w.add_tensor(gguf_name(name), b.data.numpy(), raw_dtype=GGMLQuantizationType[b.qtype])
        else:  # norms
            w.add_tensor(gguf_name(name), rng.uniform(0.8, 1.2, size=shape).astype(np.float32))
    return finish(w, path)


@pytest.fixture(scope="module")
def models(kquant_gguf: Path) -> tuple[LoadedModel, LoadedModel, torch.nn.Module]:
    hf = AutoModelForCausalLM.from_pretrained(kquant_gguf.parent, gguf_file=kquant_gguf.name, dtype=torch.float32)
    return (
        load_model(str(kquant_gguf), CPUBackend(), quantization="auto"),  # native blocks
        load_model(str(kquant_gguf), CPUBackend(), quantization="none"),  # dequantized at load
        hf.eval(),
    )


def test_every_linear_stays_in_the_files_blocks(models, kquant_gguf: Path) -> None:  # noqa: ANN001
    native_lm, _, _ = models
    layer0, layer1 = native_lm.model.layers
    segments = {
        "qkv0": layer0.self_attn.qkv_proj.method.segments, "gate_up0": layer0.mlp.gate_up_proj.method.segments,
        "qkv1": layer1.self_attn.qkv_proj.method.segments, "gate_up1": layer1.mlp.gate_up_proj.method.segments,
    }
    x8 = "x8" if native.packs_at_16_bits() else ""  # Q5_0 / Q8_0 / Q4_K repacked at 16 bits in the zmm builds
    assert segments == {
        "qkv0": (("Q4_K" + x8, 384), ("Q6_K", 128)), "gate_up0": (("Q2_K", 1024),),
        "qkv1": (("Q5_0" + x8, 384), ("Q8_0" + x8, 128)), "gate_up1": (("Q4_K" + x8, 512), ("Q5_K", 512)),
    }
    linears = [m for m in native_lm.model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * 2 + 2 and all(isinstance(m.method, GGUFBlockMethod) for m in linears)
    weight_bytes = sum(m.weight.numel() for m in linears)
    tensor_bytes = kquant_gguf.stat().st_size - sum(p.numel() * 4 for n, p in native_lm.model.named_parameters()
                                                     if "norm" in n)
    assert weight_bytes <= tensor_bytes <= weight_bytes + 64 * 1024  # the file's blocks; metadata and padding aside


def test_logits_match_transformers(models) -> None:  # noqa: ANN001
    native_lm, float_lm, hf = models
    for prompt in PROMPTS:
        with torch.no_grad():
            expect = hf(torch.tensor([prompt])).logits[0]
        dequantized = PagedSession(float_lm, 1, len(prompt)).feed([prompt])[0]
        torch.testing.assert_close(dequantized, expect, rtol=0, atol=1e-4 * float(expect.abs().max()))
        got = PagedSession(native_lm, 1, len(prompt)).feed([prompt])[0]
        torch.testing.assert_close(got, expect, rtol=0, atol=1e-3 * float(expect.abs().max()))


def test_greedy_equals_transformers_and_the_dequantized_model(models) -> None:  # noqa: ANN001
    native_lm, float_lm, hf = models
    got = greedy(native_lm, PROMPTS, 16)
    assert got == greedy(float_lm, PROMPTS, 16)
    for prompt, tokens in zip(PROMPTS, got):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                              eos_token_id=None)
        assert tokens == out[0, len(prompt):].tolist()
    assert len({t for tokens in got for t in tokens}) > 4  # not a degenerate repetition


def test_fused_decoder_layer_reads_mixed_segments(models, kquant_gguf: Path) -> None:  # noqa: ANN001
    """The one-C-call decoder layer (the runner's CPU fast path) on the same mixed layers:
    decode logits bit for bit those of the module path."""
    native_lm, _, _ = models
    fused = load_model(str(kquant_gguf), CPUBackend(), quantization="auto")
    assert fuse_decoder_layers(fused.model) == CONFIG.num_hidden_layers
    sessions = [PagedSession(lm, len(PROMPTS), 24) for lm in (fused, native_lm)]
    last = [[row[-1] for row in s.feed(PROMPTS)] for s in sessions]
    for _ in range(4):
        step = [[int(row.argmax())] for row in last[1]]
        last = [s.feed(step) for s in sessions]
        assert all(torch.equal(a, b) for a, b in zip(*last))


def test_eight_bit_activations_stay_near_transformers(models, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """``TREADLE_ACTIVATION_BITS=8``: the Q4_K / Q5_K / Q6_K segments (q/k/v, gate/up, lm_head) and
    the legacy ones take int8 activations (Q2_K / Q3_K keep 16 bits). The logits move away from
    the 16-bit path's, but stay within 8-bit rounding of transformers' (5% of their range) with
    the same argmax at every prompt position, and greedy decoding is not degenerate. (Random
    weights amplify the rounding: 2.3% observed at 8 bits, 0.01% at 16.)"""
    native_lm, _, hf = models
    for prompt in PROMPTS:
        with torch.no_grad():
            expect = hf(torch.tensor([prompt])).logits[0]
        y16 = PagedSession(native_lm, 1, len(prompt)).feed([prompt])[0]
        monkeypatch.setenv("TREADLE_ACTIVATION_BITS", "8")
        y8 = PagedSession(native_lm, 1, len(prompt)).feed([prompt])[0]
        monkeypatch.setenv("TREADLE_ACTIVATION_BITS", "16")
        err8, err16 = float((y8 - expect).abs().max()), float((y16 - expect).abs().max())
        assert err8 > err16 and err8 < 0.05 * float(expect.abs().max())
        assert bool((y8.argmax(-1) == expect.argmax(-1)).all())
    monkeypatch.setenv("TREADLE_ACTIVATION_BITS", "8")
    got = greedy(native_lm, PROMPTS, 16)
    assert len({t for tokens in got for t in tokens}) > 4


def test_eight_bit_prefill_is_the_same_bits_with_and_without_amx(models, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """A 128-token prefill (two prompts of 64) with 8-bit activations: every Q4_K / Q5_K / Q6_K matmul
    of the step (q/k/v, o, gate/up, down and the lm_head over all 128 rows) takes the amx build's AMX
    tiles (q8amx.c), the avx512-bf16 build (the same sources without AMX) its vpdpbusd strips; both
    give the plain-C reference's bits, so the logits are equal bit for bit."""
    native_lm, _, _ = models
    monkeypatch.setenv("TREADLE_ACTIVATION_BITS", "8")
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, CONFIG.vocab_size, (64,), generator=g).tolist() for _ in range(2)]
    logits = {}
    for variant in ("amx", "avx512-bf16"):
        force(monkeypatch, variant)
        logits[variant] = PagedSession(native_lm, 2, 64).feed(prompts)
    assert all(torch.equal(a, b) for a, b in zip(logits["amx"], logits["avx512-bf16"]))
