"""The C paged-decode kernel (treadle.kernels.attention.paged_decode) against ReferenceBackend."""
from __future__ import annotations

import pytest
import torch
from kernel_variants import VARIANTS, force
from paged_session import scattered_block_tables

from treadle.kernels import native
from treadle.kernels.attention import paged_decode
from treadle.layers.attention import AttentionSpec, ReferenceBackend, build_attention_metadata
from treadle.layers.attention.cpu import CPUBackend
from treadle.layers.attention.kv_quant import quantize

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler: kernels off")

TOL = dict(atol=1e-5, rtol=1e-5)


def decode_case(seq_lens, num_heads, num_kv_heads, head_dim=64, block_size=16, fused=False, seed=0):
    """Random cache with shuffled (non-contiguous) block tables and random q/k/v for one decode
    token per sequence; with ``fused`` q/k/v are strided views split from one qkv tensor."""
    g = torch.Generator().manual_seed(seed)
    tables, num_blocks = scattered_block_tables(seq_lens, block_size, g, spare=5)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    b, dq, dkv = len(seq_lens), num_heads * head_dim, num_kv_heads * head_dim
    if fused:
        qkv = torch.randn(b, dq + 2 * dkv, generator=g)
        q, k, v = qkv.split([dq, dkv, dkv], dim=-1)
    else:
        q, k, v = torch.randn(b, dq, generator=g), torch.randn(b, dkv, generator=g), torch.randn(b, dkv, generator=g)
    q, k, v = q.view(b, num_heads, head_dim), k.view(b, num_kv_heads, head_dim), v.view(b, num_kv_heads, head_dim)
    meta = build_attention_metadata([1] * b, seq_lens, tables, block_size)
    return q, k, v, k_cache, v_cache, meta


def kernel_args(meta):
    return meta.slot_mapping.contiguous(), meta.block_tables.contiguous(), meta.seq_lens_tensor.contiguous()


def reference(q, k, v, k_cache, v_cache, meta, spec):
    kc, vc = k_cache.clone(), v_cache.clone()
    return ReferenceBackend().forward(q, k, v, kc, vc, meta, spec), kc, vc


SEQ_LENS = [1, 15, 16, 17, 300, 1000]
HEADS = [(4, 4), (8, 2), (6, 1), (9, 3)]  # MHA, GQA, MQA, SmolLM2


@pytest.mark.parametrize("heads", HEADS, ids=["mha", "gqa", "mqa", "smollm2"])
@pytest.mark.parametrize("window", [None, 48], ids=["full", "window48"])
def test_matches_reference(heads: tuple[int, int], window: int | None) -> None:
    q, k, v, k_cache, v_cache, meta = decode_case(SEQ_LENS, *heads)
    spec = AttentionSpec(*heads, 64, 64**-0.5, window)
    ref, kc_ref, vc_ref = reference(q, k, v, k_cache, v_cache, meta, spec)
    out = paged_decode(q, k, v, k_cache, v_cache, *kernel_args(meta), spec.scale, window)
    assert out is not None
    torch.testing.assert_close(out, ref, **TOL)
    assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref)


@pytest.mark.parametrize("seq_lens", [[1000], [3001], [257], [20, 2999]], ids=str)
@pytest.mark.parametrize("window", [None, 100, 700], ids=["full", "w100", "w700"])
def test_split_contexts(seq_lens: list[int], window: int | None) -> None:
    """Few sequences with long contexts: split into chunks (some empty for the short one)."""
    q, k, v, k_cache, v_cache, meta = decode_case(seq_lens, 8, 2, block_size=32, seed=3)
    spec = AttentionSpec(8, 2, 64, 0.125, window)
    ref, _, _ = reference(q, k, v, k_cache, v_cache, meta, spec)
    out = paged_decode(q, k, v, k_cache, v_cache, *kernel_args(meta), spec.scale, window)
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("head_dim", [12, 40, 96, 128])
def test_head_dims(head_dim: int) -> None:
    """Head sizes with a scalar tail (12), 8-wide pieces only (40), 32 + 32 + 32, 4 x 32."""
    q, k, v, k_cache, v_cache, meta = decode_case([5, 70, 400], 4, 2, head_dim=head_dim, seed=4)
    spec = AttentionSpec(4, 2, head_dim, head_dim**-0.5)
    ref, kc_ref, _ = reference(q, k, v, k_cache, v_cache, meta, spec)
    out = paged_decode(q, k, v, k_cache, v_cache, *kernel_args(meta), spec.scale)
    torch.testing.assert_close(out, ref, **TOL)
    assert torch.equal(k_cache, kc_ref)


@pytest.mark.parametrize("block_size", [1, 7, 128])
def test_block_sizes(block_size: int) -> None:
    """Blocks of one key, of an odd count, and longer than the kernel's 64-key tile."""
    q, k, v, k_cache, v_cache, meta = decode_case([3, 130, 700], 8, 2, block_size=block_size, seed=7)
    spec = AttentionSpec(8, 2, 64, 0.125, 200)
    ref, kc_ref, _ = reference(q, k, v, k_cache, v_cache, meta, spec)
    out = paged_decode(q, k, v, k_cache, v_cache, *kernel_args(meta), spec.scale, 200)
    torch.testing.assert_close(out, ref, **TOL)
    assert torch.equal(k_cache, kc_ref)


def test_fused_qkv_views_and_skipped_slot() -> None:
    """q/k/v split from one [B, (H + 2 Hkv) D] tensor (row stride > row length); a negative
    slot writes nothing (its sequence then attends over what the cache already holds)."""
    q, k, v, k_cache, v_cache, meta = decode_case(SEQ_LENS, 8, 2, fused=True, seed=5)
    assert not q.is_contiguous() and q.stride(0) == k.stride(0) == (8 + 4) * 64
    skipped = int(meta.slot_mapping[3])
    meta.slot_mapping[3] = -1
    spec = AttentionSpec(8, 2, 64, 0.125)
    ref, kc_ref, vc_ref = reference(q, k, v, k_cache, v_cache, meta, spec)
    before = k_cache.view(-1, 2, 64)[skipped].clone()
    out = paged_decode(q, k, v, k_cache, v_cache, *kernel_args(meta), spec.scale)
    torch.testing.assert_close(out, ref, **TOL)
    assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref)
    assert torch.equal(k_cache.view(-1, 2, 64)[skipped], before)
    slot = int(meta.slot_mapping[4])
    assert torch.equal(k_cache.view(-1, 2, 64)[slot], k[4]) and torch.equal(v_cache.view(-1, 2, 64)[slot], v[4])


@pytest.mark.parametrize("window", [None, 48], ids=["full", "window48"])
def test_bfloat16_cache_matches_float32_reference_on_the_same_values(window: int | None) -> None:
    """A bfloat16 model's cache: q/k/v and cache in bfloat16, read widened to float32 exactly;
    the oracle is the float32 reference on the same (bfloat16) values, the output rounded once."""
    *tensors, meta = decode_case(SEQ_LENS, 9, 3)
    q, k, v, k_cache, v_cache = (t.bfloat16() for t in tensors)
    spec = AttentionSpec(9, 3, 64, 64**-0.5, window)
    ref, kc_ref, vc_ref = reference(q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), meta, spec)
    out = paged_decode(q, k, v, k_cache, v_cache, *kernel_args(meta), spec.scale, window)
    assert out is not None and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=1e-5, rtol=2**-8)
    assert torch.equal(k_cache.float(), kc_ref) and torch.equal(v_cache.float(), vc_ref)


@VARIANTS
@pytest.mark.parametrize("head_dim,window,heads", [(64, None, (9, 3)), (64, 48, (9, 3)), (40, None, (9, 3)),
                                                   (64, None, (8, 4)), (128, 48, (6, 2)), (64, None, (16, 2)),
                                                   (256, None, (4, 1))],
                         ids=["d64", "d64-window48", "d40", "d64-g2", "d128-g3-window48", "d64-g8", "d256-g4"])
def test_bfloat16_cache_of_a_float32_model_gives_the_float32_cache_bits(
    variant: str, head_dim: int, window: int | None, heads: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """float32 q/k/v over a bfloat16 cache (``kv_cache_dtype`` bfloat16 on a float32 model). Every
    variant reads it in place, at half the bytes, with a float32 cache's arithmetic (each load
    widened in the register; d40 takes the scalar tails past 8 / 16 lanes; 2, 3, 4 and 8 query heads
    a KV head, scored up to 3 at a time in the AVX-512 builds; head sizes 40 to 256), so the output
    equals, bit for bit, that of a float32 cache holding the same values; the new rows are written
    rounded to nearest even, as torch rounds them."""
    force(monkeypatch, variant)
    q, k, v, k_cache, v_cache, meta = decode_case(SEQ_LENS, *heads, head_dim=head_dim, seed=11)
    kc16, vc16 = k_cache.bfloat16(), v_cache.bfloat16()
    kc32, vc32 = kc16.float(), vc16.float()
    scale = head_dim**-0.5
    out16 = paged_decode(q, k, v, kc16, vc16, *kernel_args(meta), scale, window)
    out32 = paged_decode(q, k.bfloat16().float(), v.bfloat16().float(), kc32, vc32, *kernel_args(meta), scale, window)
    assert out16 is not None and out16.dtype == torch.float32
    assert torch.equal(out16, out32)
    assert torch.equal(kc16.float(), kc32) and torch.equal(vc16.float(), vc32)


@VARIANTS
def test_bfloat16_cache_rows_are_written_as_torch_rounds_them_ties_included(
    variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new rows of a bfloat16 cache, written 8 values at a time where the build has SIMD: values
    exactly halfway between two bfloat16 numbers (odd and even last bits: ties go to even), near
    ties, signs, tiny and large magnitudes; rows of 3 x 12 values (a tail after the 8-wide loop)."""
    force(monkeypatch, variant)
    q, k, v, k_cache, v_cache, meta = decode_case([5, 17, 40], 6, 3, head_dim=12, seed=13)
    g = torch.Generator().manual_seed(14)
    base = torch.randn(2, 3, 3, 12, generator=g).bfloat16().float()
    ulp = base.abs().view(torch.int32).bitwise_and(0x7F800000).view(torch.float32) * 2.0**-7
    step = torch.tensor([0.5, -0.5, 0.5 + 2**-10, 0.5 - 2**-10, 0.25, 0.0], dtype=torch.float32)
    values = base + ulp * step[torch.arange(base.numel()) % len(step)].view_as(base)
    values[0, 0, 0, :3] = torch.tensor([1e-30, -3e38, 65504.0])
    k, v = values[0].contiguous(), values[1].contiguous()
    kc16, vc16 = k_cache.bfloat16(), v_cache.bfloat16()
    assert paged_decode(q, k, v, kc16, vc16, *kernel_args(meta), 12**-0.5) is not None
    slots = meta.slot_mapping.view(-1)
    assert torch.equal(kc16.view(-1, 3, 12)[slots], k.bfloat16())
    assert torch.equal(vc16.view(-1, 3, 12)[slots], v.bfloat16())


@VARIANTS
@pytest.mark.parametrize("window", [None, 48], ids=["full", "window48"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn],
                         ids=["f32", "bf16", "int8", "fp8"])
def test_a_rows_bits_depend_on_its_own_context_alone(
    variant: str, window: int | None, kv_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt's tokens are rows of this kernel (the CPU backend), so a token's attention must not
    depend on how its prompt was cut, on the rows beside it, or on the thread count: each row of a
    150-token prompt, computed with the whole prompt and another sequence's decode row in one call,
    equals bit for bit the same row computed alone, on one thread or two (every cache dtype). The
    AVX-512 builds take neighbouring rows that read the same blocks together (the prompt's rows; and
    rows of a sequence sharing the prompt's first 3 blocks, as after a prefix-cache hit, beside
    prompt rows whose keys lie in those blocks, the longer row's table serving both)."""
    force(monkeypatch, variant)
    heads, d, bs, n = (8, 2), 64, 16, 150
    g = torch.Generator().manual_seed(5)
    tables, num_blocks = scattered_block_tables([n, 77], bs, g, spare=3)
    k_cache, v_cache = (cache_of(torch.randn(num_blocks, bs, heads[1], d, generator=g), kv_dtype) for _ in "kv")
    width = max(len(t) for t in tables)
    used = {b for t in tables for b in t}
    shared = tables[0][:3] + [next(b for b in range(num_blocks) if b not in used)]  # 3 blocks, then its own
    rows = [(tables[0], length) for length in range(1, n + 1)] + [(tables[1], 77)]
    rows += [(tables[0], 41), (shared, 60), (shared, 33), (tables[0], 70)]  # 41 + 60 + 33 together: 60's table
    q = torch.randn(len(rows), heads[0], d, generator=g)
    kv = torch.zeros(len(rows), heads[1], d)

    def attend(picked: list[int], threads: int) -> torch.Tensor:
        table = torch.tensor([rows[i][0] + [0] * (width - len(rows[i][0])) for i in picked], dtype=torch.int32)
        lens = torch.tensor([rows[i][1] for i in picked], dtype=torch.int32)
        slots = torch.full((len(picked),), -1, dtype=torch.int64)  # the rows are in the cache already
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out = paged_decode(q[picked], kv[: len(picked)], kv[: len(picked)], k_cache, v_cache, slots, table, lens,
                               d**-0.5, window)
        finally:
            torch.set_num_threads(before)
        assert out is not None
        return out

    together = attend(list(range(len(rows))), 2)
    assert torch.isfinite(together).all()
    for i in [0, 14, 15, 16, 47, 48, 63, 64, 65, 127, 128, 149, 150, 151, 152, 153, 154]:
        assert torch.equal(attend([i], 1), together[i : i + 1]), i
        assert torch.equal(attend([i], 2), together[i : i + 1]), i
    assert torch.equal(attend(list(range(len(rows))), 1), together)


def cache_of(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A cache of ``dtype`` holding ``x``: rounded (float32 / bfloat16) or quantized rows (int8 / fp8)."""
    return quantize(x, dtype) if dtype in (torch.int8, torch.float8_e4m3fn) else x.to(dtype)


def test_unsupported_inputs_return_none() -> None:
    q, k, v, k_cache, v_cache, meta = decode_case([5, 9], 4, 2)
    args = kernel_args(meta)
    assert paged_decode(q.to(torch.bfloat16), k, v, k_cache, v_cache, *args, 0.125) is None
    assert paged_decode(q, k, v, k_cache.to(torch.bfloat16), v_cache, *args, 0.125) is None
    assert paged_decode(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, k_cache, v_cache, *args, 0.125) is None


@pytest.mark.parametrize("window", [None, 40])
def test_cpu_backend_all_decode_uses_kernel(window: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """CPUBackend on an all-decode float32 step calls the kernel (and matches the reference);
    on a mixed step (a prompt chunk and a decode) the decode row goes to the kernel too."""
    import treadle.layers.attention.cpu as cpu

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return paged_decode(*args, **kwargs)

    monkeypatch.setattr(cpu, "paged_decode", counted)
    q, k, v, k_cache, v_cache, meta = decode_case(SEQ_LENS, 8, 2, fused=True, seed=6)
    spec = AttentionSpec(8, 2, 64, 0.125, window)
    ref, kc_ref, vc_ref = reference(q, k, v, k_cache, v_cache, meta, spec)
    out = CPUBackend().forward(q, k, v, k_cache, v_cache, meta, spec)
    assert calls == [1]
    torch.testing.assert_close(out, ref, **TOL)
    assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref)

    mixed = build_attention_metadata([3, 1], [3, 20], [[0], [1, 2]], 16)
    qm, km, vm = (torch.randn(4, h, 64) for h in (8, 2, 2))
    ref, kc_ref, vc_ref = reference(qm, km, vm, k_cache, v_cache, mixed, spec)
    out = CPUBackend().forward(qm, km, vm, k_cache, v_cache, mixed, spec)
    assert calls == [1, 1]
    torch.testing.assert_close(out, ref, **TOL)
    assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref)
