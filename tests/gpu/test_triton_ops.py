"""The per-token Triton operators the layers launch for CUDA tensors (``treadle/layers/triton_ops.py``)
under TRITON_INTERPRET=1 on CPU tensors, against the torch paths they replace: the residual sum and
RoPE bit for bit (the same roundings, no FMA), RMSNorm and the gated activations within the dtype's
rounding (the mean-square sum's order and exp differ). benchmarks/gpu_engine_check.py runs them on
a GPU inside whole models against transformers.

TRITON_INTERPRET is set by this folder's conftest."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from treadle.layers import triton_ops
from treadle.layers.norm import rms_norm_plain
from treadle.layers.rotary import RotaryEmbedding, rotate_in_place

# float32 and float16 only: Triton's interpreter converts float32 to bfloat16 by truncation, not to
# nearest as the GPU does (seen: 1 + 2^-8 + 2^-10 -> 1.0), so bfloat16 cannot be checked here; the
# GPU check (benchmarks/gpu_engine_check.py, "kernel: norm / gated / rope") runs the same checks
# below on CUDA tensors in every dtype
DTYPES = [torch.float32, torch.float16]
# rtol: one rounding step of the dtype (the sum's order)
STEP = {torch.float32: 1e-5, torch.float16: 2 ** -9, torch.bfloat16: 2 ** -6}


def rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype).to(device)


def check_rms_norm(dtype: torch.dtype, with_residual: bool, device: str = "cpu") -> None:
    wide = rand(5, 300, seed=1, dtype=dtype, device=device)
    x = wide[:, :200]  # strided rows, as a slice of a wider row
    residual = rand(5, 200, seed=2, dtype=dtype, device=device) if with_residual else None
    weight = (1 + 0.1 * rand(200, seed=3, device=device)).to(dtype)
    want, want_sum = rms_norm_plain(x, residual, weight, 1e-6)
    got, got_sum = triton_ops.rms_norm(x, None if residual is None else residual.clone(), weight, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got_sum, want_sum)  # the residual stream: one rounded add, the same bits
    torch.testing.assert_close(got, want, rtol=STEP[dtype], atol=1e-5)


def check_gated(dtype: torch.dtype, gelu: bool, device: str = "cpu") -> None:
    gate_up = rand(3, 2 * 1500, seed=4, dtype=dtype, device=device)  # d = 1500: two column blocks, the last partial
    d = 1500
    act = F.gelu(gate_up[:, :d], approximate="tanh") if gelu else F.silu(gate_up[:, :d])
    want = act * gate_up[:, d:]
    got = triton_ops.gated(gate_up, gelu=gelu)
    assert got.dtype == dtype and got.shape == (3, d)
    torch.testing.assert_close(got, want, rtol=STEP[dtype], atol=1e-5)


def check_rope(dtype: torch.dtype, device: str = "cpu") -> None:
    rope = RotaryEmbedding(64, 512, 10000.0, None).to(device)
    qkv = rand(7, (4 + 2 + 2) * 64, seed=5, dtype=dtype, device=device)  # one qkv row per token: q and k as one view
    x = qkv[:, : 6 * 64].view(7, 6, 64)
    positions = torch.tensor([0, 1, 2, 100, 101, 511, 3], device=device)
    want = x.clone()
    cs = rope.cos_sin.index_select(0, positions).to(dtype).unsqueeze(1)
    rotate_in_place(want, cs[..., :32], cs[..., 32:])
    v_before = qkv[:, 6 * 64 :].clone()
    triton_ops.rope_(x, rope.cos_sin, positions)
    assert torch.equal(x, want)
    assert torch.equal(qkv[:, 6 * 64 :], v_before)  # v, beside it in the row, untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_plain_norm(dtype: torch.dtype, with_residual: bool) -> None:
    check_rms_norm(dtype, with_residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gelu", [False, True])
def test_gated_activations_match_torch(dtype: torch.dtype, gelu: bool) -> None:
    check_gated(dtype, gelu)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_equals_the_torch_rotation_bit_for_bit(dtype: torch.dtype) -> None:
    check_rope(dtype)
