"""Weight-only int8/int4 and native GGUF linear methods against F.linear with the
dequantized weight, plus exact packing round-trips."""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from treadle.config import ModelConfig, TreadleError
from treadle.kernels import native
from treadle.layers.linear import Linear, UnquantizedLinearMethod
from treadle.models.llama import LLAMA_LAYOUT
from treadle.quantization import weight_only_factory
from treadle.quantization.gguf_native import (
    GGUFBlockMethod,
    GGUFBlocks,
    GGUFNativePlan,
    dequantize_blocks,
    quantize_blocks,
)
from treadle.quantization.int4pack import dequantize_int4, int4_mm, pack_int4, quantize_int4, quantize_int8, scale_zeros
from treadle.quantization.weight_only import Int4WeightOnlyMethod, Int8WeightOnlyMethod

SHARDS = [64, 32, 32]  # a fused qkv-like layer, loaded shard by shard
IN = 256


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def bf16_input(x: torch.Tensor) -> torch.Tensor:
    """The kernels take bfloat16 activations; the reference sees the same rounded x."""
    return x.to(torch.bfloat16).float()


def check_close_to_reference(y: torch.Tensor, x: torch.Tensor, w_deq: torch.Tensor) -> None:
    expect = F.linear(bf16_input(x), w_deq)
    # bfloat16 output rounding: relative 2^-8 of the largest output
    torch.testing.assert_close(y, expect, rtol=0, atol=float(expect.abs().max()) * 2**-7)
    loose = F.linear(x, w_deq)  # and against unrounded activations, a little looser
    torch.testing.assert_close(y, loose, rtol=0, atol=float(loose.abs().max()) * 2**-5)


def load_linear(method, shards: list[torch.Tensor | GGUFBlocks]) -> Linear:  # noqa: ANN001
    layer = Linear(IN, SHARDS, bias=True, dtype=torch.float32, method=method)
    for i, t in enumerate(shards):
        layer.weight.weight_loader(layer.weight, t, i)
    layer.bias.weight_loader(layer.bias, rand(sum(SHARDS), seed=99), None)
    layer.method.process_weights_after_loading(layer)
    return layer


def test_int8_weight_only_matches_dequantized_linear() -> None:
    shards = [rand(n, IN, seed=i) for i, n in enumerate(SHARDS)]
    layer = load_linear(Int8WeightOnlyMethod(), shards)
    assert layer.weight.dtype == torch.int8
    w_deq = torch.cat([q.float() * s[:, None] for q, s in map(quantize_int8, shards)])
    w = torch.cat(shards)
    assert float((w - w_deq).abs().max()) <= float(w.abs().max()) / 127  # one step at most
    x = rand(5, IN, seed=10)
    check_close_to_reference(layer(x) - layer.bias, x, w_deq)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_weight_only_matches_dequantized_linear(group: int) -> None:
    shards = [rand(n, IN, seed=20 + i) for i, n in enumerate(SHARDS)]
    layer = load_linear(Int4WeightOnlyMethod(group), shards)
    assert layer.weight.dtype == torch.uint8 and layer.weight.shape == (sum(SHARDS), IN // 2)
    parts = [quantize_int4(s, group) for s in shards]
    w_deq = torch.cat([dequantize_int4(*p) for p in parts])
    scale = torch.cat([p[1] for p in parts]).repeat_interleave(group, 1)
    w = torch.cat(shards)
    assert bool(((w - w_deq).abs() <= scale * 0.51 + 1e-6).all())  # within half a step (+ rounding)
    for x in (rand(1, IN, seed=30), rand(3, 4, IN, seed=31)):  # decode row and a batch
        y = layer(x) - layer.bias
        assert y.shape == (*x.shape[:-1], sum(SHARDS))
        check_close_to_reference(y.reshape(-1, y.shape[-1]), x.reshape(-1, IN), w_deq)


def test_int4_pack_round_trip_is_exact() -> None:
    """With scale 1 and zero 0 the kernel returns q - 8 exactly: an identity input reads
    every packed nibble back."""
    q = torch.randint(0, 16, (48, 64), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    ones, zeros = torch.ones(48, 2), torch.zeros(48, 2)
    back = int4_mm(torch.eye(64), pack_int4(q), 32, scale_zeros(ones, zeros))  # [64, 48]
    assert torch.equal(back.t(), q.float() - 8)


def gguf_blocks(w: torch.Tensor, qtype: str) -> GGUFBlocks:
    data = gguf_quantize(w.numpy(), GGMLQuantizationType[qtype])
    return GGUFBlocks(qtype, torch.from_numpy(np.ascontiguousarray(data)), tuple(w.shape))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_block_decoding_equals_gguf_package(qtype: str) -> None:
    b = gguf_blocks(rand(16, 128, seed=40), qtype)
    expect = gguf_dequantize(b.data.numpy(), GGMLQuantizationType[qtype])
    assert torch.equal(dequantize_blocks(b), torch.from_numpy(expect))


def q16_activations(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the GGUF kernels round it: 16 bits per block of 32, scale max|x| / 32767."""
    b = x.reshape(*x.shape[:-1], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 32767
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(b * inv) * d).reshape(x.shape)


needs_kernels = pytest.mark.skipif(not native.available(), reason="needs a C compiler (Treadle's CPU kernels)")


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_native_matches_dequantized_linear(qtype: str) -> None:
    shards = [gguf_blocks(rand(n, IN, seed=50 + i), qtype) for i, n in enumerate(SHARDS)]
    layer = load_linear(GGUFBlockMethod(qtype), shards)
    assert layer.weight.dtype == torch.uint8 and layer.weight.numel() == sum(b.data.numel() for b in shards)
    w_deq = torch.cat([dequantize_blocks(b) for b in shards])  # exact GGUF values
    for rows in (1, 3, 4, 9):  # the kernel's row-count cases
        x = rand(rows, IN, seed=60 + rows)
        y = layer(x)
        # exact up to float32 summation order against the 16-bit-rounded activations ...
        expect = F.linear(q16_activations(x), w_deq, layer.bias)
        torch.testing.assert_close(y, expect, rtol=0, atol=float(expect.abs().max()) * 1e-5)
        # ... and within the activation rounding of the float product
        loose = F.linear(x, w_deq, layer.bias)
        torch.testing.assert_close(y, loose, rtol=0, atol=float(loose.abs().max()) * 2e-4)


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_native_rows_do_not_depend_on_the_batch(qtype: str) -> None:
    layer = load_linear(GGUFBlockMethod(qtype), [gguf_blocks(rand(n, IN, seed=90 + i), qtype) for i, n in enumerate(SHARDS)])
    x = rand(11, IN, seed=91)
    together = layer(x)
    for i in range(11):
        assert torch.equal(layer(x[i : i + 1])[0], together[i])
    assert torch.equal(layer(x[3:9]), together[3:9])


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_embedding_rows_and_dequantize_are_exact(qtype: str) -> None:
    b = gguf_blocks(rand(40, IN, seed=95), qtype)
    layer = Linear(IN, [40], False, torch.float32, GGUFBlockMethod(qtype))
    layer.weight.weight_loader(layer.weight, b, None)
    w_deq = dequantize_blocks(b)
    ids = torch.tensor([[3, 0, 39], [3, 7, 12]])
    assert torch.equal(layer.method.embedding(layer, ids, torch.float32), w_deq[ids])
    assert torch.equal(native.dequantize(qtype, b.data, IN), w_deq)


def test_gguf_block_method_rejects_wrong_shards() -> None:
    layer = Linear(IN, [32], False, torch.float32, GGUFBlockMethod("Q4_1"))
    with pytest.raises(ValueError, match="expected Q4_1 blocks, got Q8_0"):
        layer.weight.weight_loader(layer.weight, gguf_blocks(rand(32, IN, seed=1), "Q8_0"), None)
    with pytest.raises(ValueError, match="shape mismatch"):
        layer.weight.weight_loader(layer.weight, gguf_blocks(rand(16, IN, seed=1), "Q4_1"), None)


def test_gguf_plan_picks_layers_by_type(monkeypatch: pytest.MonkeyPatch) -> None:
    t = {
        "model.embed_tokens.weight": ("Q8_0", (256, 64)),
        "model.layers.0.self_attn.q_proj.weight": ("Q4_1", (64, 64)),
        "model.layers.0.self_attn.k_proj.weight": ("Q4_1", (32, 64)),
        "model.layers.0.self_attn.v_proj.weight": ("Q4_1", (32, 64)),
        "model.layers.0.self_attn.o_proj.weight": ("Q8_0", (64, 64)),
        "model.layers.0.mlp.gate_proj.weight": ("Q4_1", (96, 64)),
        "model.layers.0.mlp.up_proj.weight": ("Q4_0", (96, 64)),  # mixed types: float
        "model.layers.0.mlp.down_proj.weight": ("F32", (64, 96)),
        "lm_head.weight": ("Q6_K", (256, 64)),
    }
    plan = GGUFNativePlan(t, LLAMA_LAYOUT.shard_names)
    monkeypatch.setattr(native, "available", lambda: True)
    methods = {name: plan.method(name) for name in (
        "model.embed_tokens", "model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj",
        "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj", "lm_head",
    )}
    assert {n: getattr(m, "qtype", None) for n, m in methods.items()} == {
        "model.embed_tokens": "Q8_0", "model.layers.0.self_attn.qkv_proj": "Q4_1", "model.layers.0.self_attn.o_proj": "Q8_0",
        "model.layers.0.mlp.gate_up_proj": None, "model.layers.0.mlp.down_proj": None, "lm_head": None,
    }
    assert plan.keeps_raw("model.layers.0.self_attn.k_proj.weight")
    assert not plan.keeps_raw("model.layers.0.mlp.up_proj.weight")
    monkeypatch.setattr(native, "available", lambda: False)  # no C compiler: everything float
    assert GGUFNativePlan(t, LLAMA_LAYOUT.shard_names).method("model.layers.0.self_attn.qkv_proj") is None


def test_weight_only_factory_names(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
                               "intermediate_size": 172, "num_hidden_layers": 1, "num_attention_heads": 4})
    widths = partial(LLAMA_LAYOUT.in_features, cfg)  # what the loader hands over
    monkeypatch.setattr(native, "available", lambda: True)
    int8, int4 = weight_only_factory("int8", widths), weight_only_factory("int4", widths)
    assert int8("model.layers.0.self_attn.qkv_proj").qtype == "Q8_0"  # C kernels: GGUF blocks
    assert int4("model.layers.0.mlp.gate_up_proj").qtype == "Q4_1"
    assert isinstance(int8("model.layers.0.mlp.down_proj"), Int8WeightOnlyMethod)  # 172 inputs: torch's kernel
    assert isinstance(int4("model.layers.0.mlp.down_proj"), Int4WeightOnlyMethod)
    for name, group in (("int4-g64", 64), ("int4-g128", 128)):
        method = weight_only_factory(name, widths)("model.layers.1.self_attn.o_proj")
        assert isinstance(method, Int4WeightOnlyMethod) and method.group_size == group
    assert int4("lm_head") is None and int8("model.embed_tokens") is None
    monkeypatch.setattr(native, "available", lambda: False)
    method = weight_only_factory("int4", widths)("model.layers.1.self_attn.o_proj")
    assert isinstance(method, Int4WeightOnlyMethod) and method.group_size == 32
    with pytest.raises(TreadleError):
        weight_only_factory("int3", widths)


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_float_shards_become_gguf_blocks_on_arrival(qtype: str) -> None:
    shards = [rand(n, IN, seed=80 + i) for i, n in enumerate(SHARDS)]
    layer = load_linear(GGUFBlockMethod(qtype), shards)
    blocks = [quantize_blocks(w, qtype) for w in shards]
    assert torch.equal(layer.weight, torch.cat([b.data for b in blocks]))
    w_deq = torch.cat([dequantize_blocks(b) for b in blocks])
    x = rand(3, IN, seed=81)
    expect = F.linear(q16_activations(x), w_deq, layer.bias)
    torch.testing.assert_close(layer(x), expect, rtol=0, atol=float(expect.abs().max()) * 1e-5)


def test_int4_unsupported_shape_stays_float() -> None:
    layer = Linear(172, [64], False, torch.float32, Int4WeightOnlyMethod(32))  # 172 % 32 != 0
    w = rand(64, 172, seed=90)
    layer.weight.weight_loader(layer.weight, w, None)
    layer.method.process_weights_after_loading(layer)
    assert isinstance(layer.method.fallback, UnquantizedLinearMethod)
    x = rand(3, 172, seed=91)
    assert torch.equal(layer(x), F.linear(x, w))
