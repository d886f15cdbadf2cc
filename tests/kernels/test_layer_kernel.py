"""The fused decoder layer (one C call per layer, treadle/kernels/csrc/layer.c) on all-decode
CPU steps gives exactly what the module path gives (the same kernels one by one), on tiny
GGUF-block models of each architecture: GQA, Qwen2's qkv bias, Mistral's sliding window,
and on float checkpoints in bfloat16 (bfloat16 weight rows in the C layer);
and through the engine, ``fused_layers=False`` changes nothing but the path."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize
from paged_session import PagedSession
from tiny_models import make_tiny_model

from treadle import LLM, SamplingParams
from treadle.kernels import native
from treadle.kernels.layer import DecoderLayerKernel
from treadle.layers.attention.cpu import DECODE_ROWS_MAX, CPUBackend
from treadle.layers.fused_decoder import FusedDecoderLayer, FusedDecoderStack
from treadle.loaders import LoadedModel, load_model, open_model_source
from treadle.models.registry import model_class
from treadle.quantization.methods.gguf_native import GGUFBlockMethod, GGUFBlocks
from treadle.worker.fused_layers import fuse_decoder_layers

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not native.available(), reason="needs a C compiler (Treadle's CPU kernels)"),
]

FLOAT = ("model.embed_tokens", "lm_head")


def gguf_block_model(path: Path, qtype: str) -> LoadedModel:
    """The checkpoint with every linear layer quantized to GGUF blocks (embedding float)."""
    src = open_model_source(str(path))
    model = model_class(src.config.architecture)(
        src.config, CPUBackend(), torch.float32, method=lambda name: None if name in FLOAT else GGUFBlockMethod(qtype))

    def weights():  # noqa: ANN202
        for name, t in src.weights():
            if t.dim() == 2 and not name.startswith(FLOAT):
                data = gguf_quantize(t.numpy(), GGMLQuantizationType[qtype])
                yield name, GGUFBlocks(qtype, torch.from_numpy(data), tuple(t.shape))
            else:
                yield name, t

    model.load_weights(weights())
    model.process_weights_after_loading()
    return LoadedModel(model.eval(), src.config, src.tokenizer, path)


def decode_logits(lm: LoadedModel, prompts: list[list[int]], steps: int,
                  cache_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    session = PagedSession(lm, len(prompts), max(map(len, prompts)) + steps, block_size=4, cache_dtype=cache_dtype)
    rows = session.feed(prompts)
    out = []
    for _ in range(steps):
        nxt = [[int(r[-1].argmax())] for r in rows]
        rows = session.feed(nxt)
        out.append(torch.stack([r[-1] for r in rows]))
    return out


def count_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per layer the C kernel runs (a whole stack is one call of many layers)."""
    calls: list[int] = []
    run = DecoderLayerKernel.__call__
    monkeypatch.setattr(DecoderLayerKernel, "__call__",
                        lambda self, *a: (calls.extend([1] * len(self.weights)), run(self, *a))[1])
    return calls


@pytest.mark.parametrize(
    "arch,qtype,overrides",
    [
        ("llama", "Q4_1", {}),
        ("qwen2", "Q8_0", {}),
        ("mistral", "Q4_0", {"sliding_window": 6}),
        ("phi3", "Q8_0", {}),
    ],
)
def test_fused_layer_equals_module_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str,
                                        qtype: str, overrides: dict) -> None:
    path = make_tiny_model(tmp_path / arch, arch, seed=3, hidden_size=64, intermediate_size=96,
                           num_attention_heads=4, num_key_value_heads=2, **overrides)
    fused, modules = gguf_block_model(path, qtype), gguf_block_model(path, qtype)
    assert fuse_decoder_layers(fused.model) == fused.config.num_layers
    calls = count_calls(monkeypatch)
    prompts = [[5, 9, 13, 2, 7], [3] * (DECODE_ROWS_MAX + 3), [8, 4]]  # one prompt too long for decode rows
    got = decode_logits(fused, prompts, 9)
    assert len(calls) == (1 + 9) * fused.config.num_layers  # every step, every layer (prompt tokens are decode rows)
    for a, b in zip(got, decode_logits(modules, prompts, 9)):
        assert torch.equal(a, b)
    assert isinstance(fused.model.decoder, FusedDecoderStack)  # the steps above ran it: one call for all layers
    fused.model.decoder = fused.model.decoder.fallback  # layer by layer, one call each: the same bits
    for a, b in zip(decode_logits(fused, prompts, 9), got):
        assert torch.equal(a, b)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_packed_fused_layers_equal_the_file_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  qtype: str) -> None:
    """With 8-bit activations at load, Q4_0 / Q4_1 weights are packed 8 rows at a time
    (GGUFBlockMethod.process_weights_after_loading); the fused packed layers give the bits of
    the module path on the file's layout with 8-bit activations. (The file's layout: loaded at
    16 bits by the plain-C build, which does not pack them then, native.packs_at_16_bits.)"""
    path = make_tiny_model(tmp_path / "llama", "llama", seed=4, hidden_size=64, intermediate_size=96,
                           num_attention_heads=4, num_key_value_heads=2)
    monkeypatch.setenv("TREADLE_ACTIVATION_BITS", "16")
    with monkeypatch.context() as mp:
        mp.setenv("TREADLE_CPU_KERNELS", "plain")
        modules = gguf_block_model(path, qtype)
    monkeypatch.setenv("TREADLE_ACTIVATION_BITS", "8")
    packed = gguf_block_model(path, qtype)
    assert packed.model.layers[0].mlp.gate_up_proj.method.segments == ((qtype + "x8", 192),)
    assert modules.model.layers[0].mlp.gate_up_proj.method.segments == ((qtype, 192),)
    assert fuse_decoder_layers(packed.model) == packed.config.num_layers
    prompts = [[5, 9, 13, 2, 7], [3, 1, 4], [8, 4]]
    for a, b in zip(decode_logits(packed, prompts, 6), decode_logits(modules, prompts, 6)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 6})])
@pytest.mark.parametrize("cache", [torch.bfloat16, torch.float32])
def test_fused_bfloat16_layer_equals_module_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str,
                                                 overrides: dict, cache: torch.dtype) -> None:
    """A float checkpoint in bfloat16 (bfloat16 weights, float32 activations): its layers are
    fused too ("BF16" layout segments), with the same bits as the module path."""
    path = make_tiny_model(tmp_path / arch, arch, seed=4, hidden_size=64, intermediate_size=96,
                           num_attention_heads=4, num_key_value_heads=2, **overrides)
    fused, modules = (load_model(str(path), CPUBackend(), dtype="bfloat16") for _ in range(2))
    assert fuse_decoder_layers(fused.model) == fused.config.num_layers
    calls = count_calls(monkeypatch)
    prompts = [[5, 9, 13, 2, 7], [3] * (DECODE_ROWS_MAX + 3), [8, 4]]
    got = decode_logits(fused, prompts, 7, cache)
    assert len(calls) == (1 + 7) * fused.config.num_layers  # the prompt step too
    for a, b in zip(got, decode_logits(modules, prompts, 7, cache)):
        assert torch.equal(a, b)


def test_qwen3_and_float_layers_are_not_fused(tmp_path: Path) -> None:
    """q/k norms are not in the C layer; float32 weights have no layout type: both keep modules."""
    qwen3 = gguf_block_model(make_tiny_model(tmp_path / "qwen3", "qwen3"), "Q8_0")
    assert fuse_decoder_layers(qwen3.model) == 0
    src = open_model_source(str(make_tiny_model(tmp_path / "llama", "llama")))
    model = model_class(src.config.architecture)(src.config, CPUBackend())
    assert fuse_decoder_layers(model) == 0


def test_engine_switch_selects_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = make_tiny_model(tmp_path / "llama", "llama", seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 9, 13, 2, 7]}, {"prompt_token_ids": [3] * 11}]
    outs = {}
    for fused in (True, False):
        llm = LLM(str(path), quantization="int4", fused_layers=fused, num_kv_blocks=64, block_size=4)
        layers = llm.engine.model_runner().model.layers  # the in-process worker
        assert all(isinstance(layer, FusedDecoderLayer) == fused for layer in layers)
        calls = count_calls(monkeypatch)
        outs[fused] = llm.generate(prompts, params, use_tqdm=False)
        assert bool(calls) == fused
    for a, b in zip(outs[True], outs[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
