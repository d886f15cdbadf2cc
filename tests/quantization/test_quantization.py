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
from gguf_files import random_blocks

from treadle.config import ModelConfig, TreadleError
from treadle.kernels import native
from treadle.layers.linear import Linear, UnquantizedLinearMethod
from treadle.models.llama import LLAMA_LAYOUT
from treadle.quantization import weight_only_factory
from treadle.quantization.methods.gguf_native import (
    NATIVE_TYPES,
    GGUFBlockMethod,
    GGUFBlocks,
    GGUFNativePlan,
    dequantize_blocks,
    quantize_blocks,
)
from treadle.quantization.methods.int4pack import (
    dequantize_int4,
    int4_mm,
    int8_mm,
    pack_int4,
    quantize_int4,
    quantize_int8,
    scale_zeros,
)
from treadle.quantization.methods.weight_only import Int4WeightOnlyMethod, Int8WeightOnlyMethod

SHARDS = [64, 32, 32]  # a fused qkv-like layer, loaded shard by shard
IN = 512  # two K-quant super-blocks per row


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


def q16_activations(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the GGUF kernels round it: 16 bits per block of 32, scale max|x| / 32767."""
    b = x.reshape(*x.shape[:-1], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 32767
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(b * inv) * d).reshape(x.shape)


needs_kernels = pytest.mark.skipif(not native.available(), reason="needs a C compiler (Treadle's CPU kernels)")
# the kernels as built for this machine (AVX2 where it has it) and the plain-C reference build
BUILDS = pytest.mark.parametrize("plain", [False, True], ids=["native", "plain-c"])
MIXES = [("Q4_K", "Q4_K", "Q6_K"), ("Q5_0", "Q8_0", "Q5_1"), ("Q2_K", "Q3_K", "Q5_K")]  # per-shard block types


class PlainBlockMethod(GGUFBlockMethod):
    """GGUFBlockMethod on the plain-C build of the kernels."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return native.qmatmul(self.segments, layer.weight, x, layer.bias, plain=True)


def block_layer(qtypes: str | tuple[str, ...], seed: int, plain: bool = False) -> tuple[Linear, torch.Tensor]:
    """A fused layer of SHARDS loaded from random blocks, and its exact dequantized weight."""
    types = [qtypes] * len(SHARDS) if isinstance(qtypes, str) else list(qtypes)
    shards = [random_blocks(t, n, IN, seed=seed + i) for i, (t, n) in enumerate(zip(types, SHARDS))]
    layer = load_linear((PlainBlockMethod if plain else GGUFBlockMethod)(qtypes), shards)
    assert layer.weight.dtype == torch.uint8 and layer.weight.numel() == sum(b.data.numel() for b in shards)
    return layer, torch.cat([dequantize_blocks(b) for b in shards])


@needs_kernels
@BUILDS
@pytest.mark.parametrize("qtype", NATIVE_TYPES)
def test_gguf_kernel_dequantize_equals_gguf_package(qtype: str, plain: bool) -> None:
    """Random bytes (every field and bit pattern) decode to exactly the gguf package's values."""
    b = random_blocks(qtype, 40, IN, seed=40)
    expect = torch.from_numpy(gguf_dequantize(b.data.numpy(), GGMLQuantizationType[qtype]))
    assert torch.equal(native.dequantize(qtype, b.data, 40, IN, plain=plain), expect)
    ids = torch.tensor([[3, 0, 39], [3, 7, 12]])
    assert torch.equal(native.gather_rows(qtype, b.data, ids, IN, plain=plain), expect[ids])


@needs_kernels
@BUILDS
@pytest.mark.parametrize("qtypes", [*NATIVE_TYPES, *MIXES], ids=str)
@pytest.mark.usefixtures("sixteen_bit_activations")
def test_gguf_native_matches_dequantized_linear(qtypes: str | tuple[str, ...], plain: bool) -> None:
    layer, w_deq = block_layer(qtypes, seed=50, plain=plain)
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
@BUILDS
@pytest.mark.parametrize("qtypes", [*NATIVE_TYPES, MIXES[0]], ids=str)
def test_gguf_native_rows_do_not_depend_on_the_batch(qtypes: str | tuple[str, ...], plain: bool) -> None:
    layer, _ = block_layer(qtypes, seed=90, plain=plain)
    x = rand(11, IN, seed=91)
    together = layer(x)
    for i in range(11):
        assert torch.equal(layer(x[i : i + 1])[0], together[i])
    assert torch.equal(layer(x[3:9]), together[3:9])


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q6_K"])
def test_gguf_embedding_rows_are_exact(qtype: str) -> None:
    b = random_blocks(qtype, 40, IN, seed=95)
    layer = Linear(IN, [40], False, torch.float32, GGUFBlockMethod(qtype))
    layer.weight.weight_loader(layer.weight, b, None)
    ids = torch.tensor([[3, 0, 39], [3, 7, 12]])
    assert torch.equal(layer.method.embedding(layer, ids, torch.float32), dequantize_blocks(b)[ids])


def test_gguf_block_method_rejects_wrong_shards() -> None:
    layer = Linear(IN, [32], False, torch.float32, GGUFBlockMethod("Q4_1"))
    with pytest.raises(ValueError, match="expected Q4_1 blocks, got Q8_0"):
        layer.weight.weight_loader(layer.weight, gguf_blocks(rand(32, IN, seed=1), "Q8_0"), None)
    with pytest.raises(ValueError, match="shape mismatch"):
        layer.weight.weight_loader(layer.weight, gguf_blocks(rand(16, IN, seed=1), "Q4_1"), None)
    with pytest.raises(ValueError, match="Q4_K blocks need in_features divisible by 256, not 96"):
        Linear(96, [32], False, torch.float32, GGUFBlockMethod("Q4_K"))
    mixed = Linear(IN, [32, 16], False, torch.float32, GGUFBlockMethod(("Q4_K", "Q6_K")))
    assert mixed.method.segments == (("Q4_K", 32), ("Q6_K", 16))
    with pytest.raises(ValueError, match="expected Q6_K blocks, got Q4_K"):
        mixed.weight.weight_loader(mixed.weight, random_blocks("Q4_K", 16, IN, seed=2), 1)


def test_gguf_plan_picks_layers_by_type(monkeypatch: pytest.MonkeyPatch) -> None:
    t = {
        "model.embed_tokens.weight": ("Q8_0", (256, 256)),
        "model.layers.0.self_attn.q_proj.weight": ("Q4_K", (256, 256)),
        "model.layers.0.self_attn.k_proj.weight": ("Q4_K", (128, 256)),
        "model.layers.0.self_attn.v_proj.weight": ("Q6_K", (128, 256)),  # mixed: segments
        "model.layers.0.self_attn.o_proj.weight": ("Q5_0", (256, 256)),
        "model.layers.0.mlp.gate_proj.weight": ("Q4_1", (96, 256)),
        "model.layers.0.mlp.up_proj.weight": ("F16", (96, 256)),  # a float shard: float
        "model.layers.0.mlp.down_proj.weight": ("Q4_K", (256, 96)),  # rows of 96 are no Q4_K blocks
        "lm_head.weight": ("IQ4_NL", (256, 256)),  # a type the kernels do not read
    }
    plan = GGUFNativePlan(t, LLAMA_LAYOUT.shard_names)
    monkeypatch.setattr(native, "available", lambda: True)
    methods = {name: plan.method(name) for name in (
        "model.embed_tokens", "model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj",
        "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj", "lm_head",
    )}
    assert {n: getattr(m, "qtypes", None) for n, m in methods.items()} == {
        "model.embed_tokens": ("Q8_0",), "model.layers.0.self_attn.qkv_proj": ("Q4_K", "Q4_K", "Q6_K"),
        "model.layers.0.self_attn.o_proj": ("Q5_0",),
        "model.layers.0.mlp.gate_up_proj": None, "model.layers.0.mlp.down_proj": None, "lm_head": None,
    }
    assert plan.keeps_raw("model.layers.0.self_attn.v_proj.weight")
    assert not plan.keeps_raw("model.layers.0.mlp.gate_proj.weight")
    monkeypatch.setattr(native, "available", lambda: False)  # no C compiler: everything float
    assert GGUFNativePlan(t, LLAMA_LAYOUT.shard_names).method("model.layers.0.self_attn.qkv_proj") is None


def test_weight_only_factory_names(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
                               "intermediate_size": 172, "num_hidden_layers": 1, "num_attention_heads": 4})
    widths = partial(LLAMA_LAYOUT.in_features, cfg)  # what the loader hands over
    monkeypatch.setattr(native, "available", lambda: True)
    int8, int4 = weight_only_factory("int8", widths), weight_only_factory("int4", widths)
    assert int8("model.layers.0.self_attn.qkv_proj").qtypes == ("Q8_0",)  # C kernels: GGUF blocks
    assert int4("model.layers.0.mlp.gate_up_proj").qtypes == ("Q4_1",)
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
@pytest.mark.usefixtures("sixteen_bit_activations")
def test_float_shards_become_gguf_blocks_on_arrival(qtype: str) -> None:
    shards = [rand(n, IN, seed=80 + i) for i, n in enumerate(SHARDS)]
    layer = load_linear(GGUFBlockMethod(qtype), shards)
    blocks = [quantize_blocks(w, qtype) for w in shards]
    w_deq = torch.cat([dequantize_blocks(b) for b in blocks])
    (name, rows), = layer.method.segments
    if name == qtype:  # the file's layout, byte for byte
        assert torch.equal(layer.weight, torch.cat([b.data.reshape(-1) for b in blocks]))
    else:  # repacked at load where the build packs them at 16 bits (native.packs_at_16_bits): the same values
        assert name == qtype + "x8" and native.packs_at_16_bits()
        assert torch.equal(native.dequantize(name, layer.weight.data, rows, IN), w_deq)
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


@pytest.mark.parametrize("k", [172, 100, 176])
def test_int8_weight_only_any_input_width(k: int) -> None:
    """stories260K's down_proj has 172 inputs: torch's int8 kernel crashed the process on such
    widths (K not a multiple of 8) for more than one row; every width must work and agree."""
    w = rand(64, k, seed=k)
    q, scale = quantize_int8(w)
    x = bf16_input(rand(7, k, seed=k + 1))
    want = (x.float() @ (q.float() * scale.float()[:, None]).t())
    got = int8_mm(x, q, scale.to(torch.bfloat16)).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not native.available(), reason="needs a C compiler (Treadle's CPU kernels)")
def test_int8_refuses_a_tensor_parallel_split_that_cuts_its_blocks() -> None:
    """A layer quantizes to the same blocks whatever the rank count: 192 inputs over 4 ranks
    (48 each) would cut the blocks of 32, so the split is refused; 2 ranks (96 each) is not."""
    layer = "model.layers.0.self_attn.o_proj"
    with pytest.raises(TreadleError, match="leave 48 per rank, which cuts its blocks of 32"):
        weight_only_factory("int8", lambda _: 48, lambda _: 192)(layer)
    assert isinstance(weight_only_factory("int8", lambda _: 96, lambda _: 192)(layer), GGUFBlockMethod)
    assert not isinstance(weight_only_factory("int8", lambda _: 48)(layer), GGUFBlockMethod)  # one rank: per-row
