"""Fused RMSNorm+residual, SwiGLU, GeGLU and in-place RoPE against their plain versions.

bfloat16 goes through in-place torch calls with the plain arithmetic (bit for bit);
float32 on the CPU goes through the C kernels (treadle/kernels/csrc/ops.c): RoPE is
bit for bit, RMSNorm sums its squares in another order and SwiGLU / GeGLU approximate exp,
so those agree to float32 rounding."""
from __future__ import annotations

import pytest
import torch

from treadle.config import RopeScaling
from treadle.kernels import native
from treadle.layers.activation import gelu_tanh_and_mul, silu_and_mul, silu_and_mul_plain
from treadle.layers.norm import RMSNorm, rms_norm_fused, rms_norm_plain
from treadle.layers.rotary import RotaryEmbedding, joint_view

DTYPES = [torch.float32, torch.bfloat16]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float32 and native.available():
        return torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    return torch.equal(a, b)


def rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 37])
def test_rms_norm_fused_equals_plain(dtype: torch.dtype, tokens: int) -> None:
    x, res, w = rand(tokens, 96, dtype=dtype, seed=1), rand(tokens, 96, dtype=dtype, seed=2), rand(96, seed=3)
    w = w.to(dtype)
    expect_out, expect_sum = rms_norm_plain(x, res, w, 1e-5)
    res_in = res.clone()
    out, total = rms_norm_fused(x, res_in, w, 1e-5)
    assert same(out, expect_out) and torch.equal(total, expect_sum)
    assert total.data_ptr() == res_in.data_ptr()  # the sum was written in place
    out0, total0 = rms_norm_fused(x, None, w, 1e-5)
    assert same(out0, rms_norm_plain(x, None, w, 1e-5)[0]) and total0 is x


def test_rms_norm_module_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREADLE_FUSED_OPS", "0")
    assert RMSNorm(8, 1e-6).fused is False and RotaryEmbedding(8, 16, 1e4, None).fused is False
    monkeypatch.setenv("TREADLE_FUSED_OPS", "1")
    fused, plain = RMSNorm(64, 1e-6), RMSNorm(64, 1e-6, fused=False)
    assert fused.fused and not plain.fused
    w = rand(64, seed=4)
    fused.weight.data.copy_(w)
    plain.weight.data.copy_(w)
    x, res = rand(5, 64, seed=5), rand(5, 64, seed=6)
    a, b = plain(x, res.clone()), fused(x, res.clone())
    assert same(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_silu_and_mul_equals_plain(dtype: torch.dtype) -> None:
    gate_up = rand(7, 2 * 80, dtype=dtype, seed=7)
    gate_up = gate_up * 4  # past the exp approximation's easy range
    assert same(silu_and_mul(gate_up), silu_and_mul_plain(gate_up))


@pytest.mark.parametrize("width", [80, 83])  # 83: the scalar tail after the 8-wide SIMD body
def test_gelu_tanh_and_mul_equals_torch(width: int) -> None:
    gate_up = rand(7, 2 * width, seed=8) * 4  # large |gate| too, where tanh saturates
    gate, up = gate_up[:, :width], gate_up[:, width:]
    expect = torch.nn.functional.gelu(gate, approximate="tanh") * up
    assert torch.allclose(gelu_tanh_and_mul(gate_up), expect, rtol=1e-6, atol=1e-6)


def split_qkv(qkv: torch.Tensor, heads: int, kv_heads: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    return q.view(-1, heads, d), k.view(-1, kv_heads, d)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "scaling", [None, RopeScaling("llama3", 8.0, 1.0, 4.0, 64)], ids=["default", "llama3"]
)
def test_rope_in_place_equals_plain(dtype: torch.dtype, scaling: RopeScaling | None) -> None:
    heads, kv_heads, d, tokens = 6, 2, 32, 11
    fused = RotaryEmbedding(d, 512, 10000.0, scaling, fused=True)
    plain = RotaryEmbedding(d, 512, 10000.0, scaling, fused=False)
    positions = torch.randperm(512, generator=torch.Generator().manual_seed(8))[:tokens]
    qkv = rand(tokens, (heads + 2 * kv_heads) * d, dtype=dtype, seed=9)
    q, k = split_qkv(qkv.clone(), heads, kv_heads, d)
    expect_q, expect_k = plain(positions, q, k)
    q2, k2 = split_qkv(qkv.clone(), heads, kv_heads, d)
    assert joint_view(q2, k2) is not None  # the one-view path is the one exercised
    out_q, out_k = fused(positions, q2, k2)
    assert out_q.data_ptr() == q2.data_ptr()  # rotated in place
    assert torch.equal(out_q, expect_q) and torch.equal(out_k, expect_k)


def test_rope_in_place_separate_tensors() -> None:
    """q and k not adjacent in memory: each is rotated on its own."""
    fused = RotaryEmbedding(16, 64, 10000.0, None, fused=True)
    plain = RotaryEmbedding(16, 64, 10000.0, None, fused=False)
    positions = torch.tensor([3, 0, 63, 17])
    q, k = rand(4, 4, 16, seed=10), rand(4, 2, 16, seed=11)
    assert joint_view(q, k) is None
    expect_q, expect_k = plain(positions, q, k)
    out_q, out_k = fused(positions, q.clone(), k.clone())
    assert torch.equal(out_q, expect_q) and torch.equal(out_k, expect_k)
