"""The quantized KV cache (kv_cache_dtype int8 / fp8): the format's error bounds, every CPU
read path (torch, the C kernel, the fused C layer's) against the reference backend on the same
quantized cache, the planner's bytes, and the option's errors. The Triton kernels' quantized
paths are checked in test_triton_attention.py (they need TRITON_INTERPRET before import)."""
from __future__ import annotations

import pytest
import torch
from paged_session import scattered_block_tables

from treadle.config import ModelConfig, TreadleError
from treadle.engine.args import engine_args
from treadle.engine.memory import plan_kv_cache
from treadle.kernels import native
from treadle.kernels.attention import paged_decode
from treadle.layers.attention import AttentionSpec, ReferenceBackend, build_attention_metadata
from treadle.layers.attention.cpu import CPUBackend
from treadle.layers.attention.kv_quant import dequantize, quantize, row_bytes

pytestmark = pytest.mark.usefixtures("one_thread")

KV_DTYPES = [torch.int8, torch.float8_e4m3fn]
IDS = ["int8", "fp8"]


def scales(packed: torch.Tensor) -> torch.Tensor:
    d = packed.shape[-1] - 4
    return packed.view(torch.uint8)[..., d:].contiguous().view(torch.float32)


def test_int8_round_trip_within_half_a_step() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 4, 64, generator=g) * torch.rand(300, 4, 1, generator=g) * 20
    packed = quantize(x, torch.int8)
    assert packed.shape == (300, 4, 68) and packed.dtype == torch.int8
    step = scales(packed)  # amax / 127
    torch.testing.assert_close(step, x.abs().amax(-1, keepdim=True) / 127)
    err = (dequantize(packed) - x).abs()
    assert bool((err <= step / 2 * (1 + 1e-5) + 1e-7).all())
    assert float(err.max()) > 0  # it does quantize


def test_fp8_round_trip_within_e4m3_rounding() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 4, 64, generator=g) * torch.exp(torch.randn(300, 4, 1, generator=g) * 3)
    packed = quantize(x, torch.float8_e4m3fn)
    step = scales(packed)  # amax / 448
    err = (dequantize(packed) - x).abs()
    # 3 mantissa bits: half an ulp is 2^-4 relative; below 2^-6 (subnormal) steps are 2^-9 * scale
    bound = torch.maximum(x.abs() * 2.0**-4, step * 2.0**-10) * (1 + 1e-5) + 1e-30
    assert bool((err <= bound).all())
    # the row's largest value is represented exactly (it maps to 448)
    top = x.abs().argmax(-1, keepdim=True)
    torch.testing.assert_close(dequantize(packed).gather(-1, top), x.gather(-1, top), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=IDS)
def test_zero_rows_decode_to_zero(dtype: torch.dtype) -> None:
    x = torch.zeros(3, 2, 8)
    x[1, 1] = torch.arange(8.0) - 4
    out = dequantize(quantize(x, dtype))
    assert torch.equal(out[0], x[0]) and float(scales(quantize(x, dtype))[0].abs().max()) == 0.0
    assert not torch.isnan(out).any()


def random_cache_case(query_lens: list[int], seq_lens: list[int], heads: tuple[int, int], dtype: torch.dtype,
                      head_dim: int = 32, block_size: int = 16, seed: int = 0):
    """A quantized cache of random stale rows, shuffled block tables, random q/k/v."""
    g = torch.Generator().manual_seed(seed)
    tables, num_blocks = scattered_block_tables(seq_lens, block_size, g, spare=5)
    shape = (num_blocks, block_size, heads[1], head_dim)
    k_cache = quantize(torch.randn(shape, generator=g) * 3, dtype)
    v_cache = quantize(torch.randn(shape, generator=g), dtype)
    t = sum(query_lens)
    q = torch.randn(t, heads[0], head_dim, generator=g)
    k, v = torch.randn(t, heads[1], head_dim, generator=g) * 3, torch.randn(t, heads[1], head_dim, generator=g)
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    return q, k, v, k_cache, v_cache, meta


def reference(q, k, v, k_cache, v_cache, meta, spec):
    kc, vc = k_cache.clone(), v_cache.clone()
    return ReferenceBackend().forward(q, k, v, kc, vc, meta, spec), kc, vc


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


HEADS = [(4, 4), (8, 2), (9, 3)]


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=IDS)
@pytest.mark.parametrize("heads", HEADS, ids=["mha", "gqa", "smollm2"])
@pytest.mark.parametrize("steps", ["decode", "mixed", "verify"])
def test_cpu_backend_matches_reference(dtype: torch.dtype, heads: tuple[int, int], steps: str) -> None:
    """All-decode (the C kernel, which also quantizes the new rows), decodes mixed with prompt
    chunks (torch writes, the kernel reads), and short verify queries."""
    query_lens = {"decode": [1] * 5, "mixed": [37, 1, 20, 1, 5], "verify": [3, 5, 1, 4, 2]}[steps]
    seq_lens = [300, 17, 90, 260, 70]
    q, k, v, k_cache, v_cache, meta = random_cache_case(query_lens, seq_lens, heads, dtype)
    spec = AttentionSpec(*heads, 32, 32**-0.5)
    want, kc_ref, vc_ref = reference(q, k, v, k_cache, v_cache, meta, spec)
    backend = CPUBackend()
    meta.plan = backend.plan(meta)
    got = backend.forward(q, k, v, k_cache, v_cache, meta, spec)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert same_bytes(k_cache, kc_ref) and same_bytes(v_cache, vc_ref)


@pytest.mark.skipif(not native.available(), reason="no C compiler: kernels off")
@pytest.mark.parametrize("dtype", KV_DTYPES, ids=IDS)
@pytest.mark.parametrize("window", [None, 48], ids=["full", "window48"])
def test_c_kernel_quantizes_and_reads_like_the_reference(dtype: torch.dtype, window: int | None) -> None:
    """The kernel's own write is bit for bit kv_quant.quantize (round half to even included:
    the new rows hold exact ties), and its attention matches the reference's."""
    seq_lens = [1, 16, 17, 300, 1000]
    q, k, v, k_cache, v_cache, meta = random_cache_case([1] * 5, seq_lens, (8, 2), dtype, head_dim=64, seed=3)
    k[0, 0, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # int8 ties at scale 1
    v[1, 1, :4] = torch.tensor([448.0, 9.0, -11.0, 0.0])  # e4m3 ties (between 8 and 10, 10 and 12)
    spec = AttentionSpec(8, 2, 64, 64**-0.5, window)
    want, kc_ref, vc_ref = reference(q, k, v, k_cache, v_cache, meta, spec)
    args = meta.slot_mapping.contiguous(), meta.block_tables.contiguous(), meta.seq_lens_tensor.contiguous()
    got = paged_decode(q, k, v, k_cache, v_cache, *args, spec.scale, window)
    assert got is not None
    assert same_bytes(k_cache, kc_ref) and same_bytes(v_cache, vc_ref)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=IDS)
def test_quantized_attention_is_close_to_float(dtype: torch.dtype) -> None:
    """The cost of quantizing: attention over the quantized cache stays near the float one."""
    q, k, v, k_cache, v_cache, meta = random_cache_case([1] * 4, [50, 200, 700, 31], (8, 2), dtype, seed=5)
    spec = AttentionSpec(8, 2, 32, 32**-0.5)
    exact, _, _ = reference(q, k, v, dequantize(k_cache), dequantize(v_cache), meta, spec)
    quant, _, _ = reference(q, k, v, k_cache, v_cache, meta, spec)
    bound = {torch.int8: 0.02, torch.float8_e4m3fn: 0.08}[dtype]
    assert float((quant - exact).abs().max()) < bound


def test_planner_holds_about_two_and_four_times_the_tokens() -> None:
    """The same memory holds int8 / fp8 rows (64 values + a 4-byte scale) ~1.9x as many
    tokens as bf16 and ~3.8x as float32: 128 / 68 and 256 / 68."""
    cfg = ModelConfig("LlamaForCausalLM", 100, 576, 1536, 30, 9, 3, 64, 1e-5, 1e4, 2048, True)
    budget = 512 << 20

    def blocks(dtype: torch.dtype) -> int:
        plan = plan_kv_cache(cfg, dtype, 2048, 1024, 1 << 40, 0, block_size=16, kv_cache_memory=budget,
                             memory_fraction=0.5, num_blocks=None, on_cpu=True)
        assert plan.bytes_per_block == 2 * 30 * 16 * 3 * row_bytes(64, dtype)
        return plan.num_blocks

    f32, bf16, i8, f8 = (blocks(d) for d in (torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn))
    assert i8 == f8
    assert 1.85 < i8 / bf16 < 2.0 and 3.7 < i8 / f32 < 4.0
    assert row_bytes(64, torch.int8) == 68 and row_bytes(64, torch.bfloat16) == 128


@pytest.mark.parametrize("value", ["int4", "fp16", "INT8", ""])
def test_unknown_kv_cache_dtype_is_one_line_error(value: str) -> None:
    from treadle.engine.resolver import resolve_config
    from treadle.loaders import open_model_source

    with pytest.raises(TreadleError, match="kv_cache_dtype .* is not one of auto, bfloat16, int8, fp8") as info:
        resolve_config(engine_args("stories260k", kv_cache_dtype=value, num_kv_blocks=4),
                       open_model_source("stories260k"), 1 << 34)
    assert "\n" not in str(info.value)


def test_head_dim_the_layout_cannot_hold_is_one_line_error() -> None:
    from treadle.layers.attention.kv_quant import row_width

    with pytest.raises(TreadleError, match="head_dim divisible by 4"):
        row_width(30, torch.int8)


def test_resolved_config_and_cli_flag() -> None:
    from treadle.engine.cli_args import add_engine_args  # the flags come from EngineArgs
    from treadle.engine.resolver import resolve_config
    from treadle.loaders import open_model_source

    source = open_model_source("stories260k")
    auto = resolve_config(engine_args("stories260k", num_kv_blocks=4), source, 1 << 34)
    quant = resolve_config(engine_args("stories260k", kv_cache_dtype="fp8", num_kv_blocks=4), source, 1 << 34)
    assert auto.cache.kv_cache_dtype == "float32" and quant.cache.kv_cache_dtype == "fp8"
    assert quant.cache.bytes_per_block < auto.cache.bytes_per_block
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"
    assert "int8" in parser.format_help() and "--kv-cache-dtype" in parser.format_help()


@pytest.mark.skipif(not native.available(), reason="no C compiler: kernels off")
@pytest.mark.parametrize("dtype", KV_DTYPES, ids=IDS)
def test_c_kernel_decodes_every_code(dtype: torch.dtype) -> None:
    """One cached key: attention returns its value row exactly, so the kernel's decoding of every
    int8 / e4m3 byte (subnormals and signs included) must equal kv_quant.dequantize's."""
    codes = torch.arange(256, dtype=torch.int32)
    if dtype == torch.float8_e4m3fn:
        codes[(codes & 0x7F) == 0x7F] = 0  # the two NaN codes are never written
    heads, d = 4, 64
    values = codes.to(torch.uint8).view(1, 1, heads, d)
    scale = torch.full((1, 1, heads, 1), 0.37).view(torch.uint8)
    v_cache = torch.cat([values, scale], dim=-1).view(dtype)
    k_cache = quantize(torch.randn(1, 1, heads, d), dtype)
    q = torch.randn(1, heads, d)
    slots = torch.tensor([-1])  # nothing written: read the crafted row
    out = paged_decode(q, q[:, :heads], q[:, :heads], k_cache, v_cache, slots,
                       torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), d**-0.5)
    assert out is not None
    assert torch.equal(out, dequantize(v_cache)[0])
