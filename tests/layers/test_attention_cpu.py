"""CPUBackend against ReferenceBackend on random inputs and scattered block tables."""
from __future__ import annotations

import pytest
import torch

from treadle.layers.attention import AttentionSpec, ReferenceBackend, build_attention_metadata
from treadle.layers.attention.cpu import CPUBackend

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def run_both(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    dtype: torch.dtype,
    sliding_window: int | None = None,
    head_dim: int = 32,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fill the cache with random context, run both backends on random q/k/v; return
    (cpu_out, ref_out, cpu_cache, ref_cache)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + 7
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered, non-contiguous
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    n = sum(query_lens)
    q = torch.randn(n, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    spec = AttentionSpec(num_heads, num_kv_heads, head_dim, head_dim**-0.5, sliding_window)
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    ref = ReferenceBackend().forward(q, k, v, kc_ref, vc_ref, meta, spec)
    backend = CPUBackend()
    meta.plan = backend.plan(meta)  # as the runner does, once per step
    out = backend.forward(q, k, v, k_cache, v_cache, meta, spec)
    return out, ref, k_cache, kc_ref


HEADS = [(4, 4), (8, 2), (6, 1)]  # MHA, GQA, MQA


@pytest.mark.parametrize("heads", HEADS, ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_decode_batch(heads: tuple[int, int], block_size: int, dtype: torch.dtype) -> None:
    seq_lens = [1, 17, 100, 333, 64, 1000]  # several not multiples of the block size
    out, ref, kc, kc_ref = run_both([1] * len(seq_lens), seq_lens, *heads, block_size, dtype)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    assert torch.equal(kc, kc_ref)


@pytest.mark.parametrize("heads", HEADS, ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_single_long_decode_splits(heads: tuple[int, int], dtype: torch.dtype) -> None:
    """One sequence, long context: many split-KV chunks, the last one partial."""
    out, ref, _, _ = run_both([1], [3001], *heads, 16, dtype)
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("heads", HEADS, ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_mixed_prefill_chunks_and_decode(heads: tuple[int, int], block_size: int, dtype: torch.dtype) -> None:
    # fresh prompt, chunk after cached context, decodes, chunk ending mid-block
    query_lens = [37, 1, 20, 1, 1, 5]
    seq_lens = [37, 50, 90, 1, 129, 70]
    out, ref, kc, kc_ref = run_both(query_lens, seq_lens, *heads, block_size, dtype)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    assert torch.equal(kc, kc_ref)


def test_prefill_only_batch_and_empty_sequence() -> None:
    out, ref, _, _ = run_both([16, 0, 45], [16, 30, 100], 8, 2, 16, torch.float32)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("query_lens,seq_lens", [([1, 1], [40, 300]), ([30, 1], [80, 200])])
def test_sliding_window(query_lens: list[int], seq_lens: list[int]) -> None:
    out, ref, _, _ = run_both(query_lens, seq_lens, 8, 2, 16, torch.float32, sliding_window=48)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_skipped_slots_are_not_written() -> None:
    g = torch.Generator().manual_seed(1)
    meta = build_attention_metadata([3], [3], [[2]], 16)
    meta.slot_mapping[1] = -1
    spec = AttentionSpec(4, 2, 16, 0.25)
    k_cache = torch.randn(4, 16, 2, 16, generator=g)
    v_cache = torch.randn(4, 16, 2, 16, generator=g)
    before = k_cache.clone()
    q, k, v = (torch.randn(3, h, 16, generator=g) for h in (4, 2, 2))
    CPUBackend().forward(q, k, v, k_cache, v_cache, meta, spec)
    assert torch.equal(k_cache[2, 0], k[0]) and torch.equal(k_cache[2, 2], k[2])
    assert torch.equal(k_cache[2, 1], before[2, 1])


def test_plan_is_rebuilt_for_a_new_step() -> None:
    """One backend instance, two different steps in a row: no stale plan."""
    backend, ref = CPUBackend(), ReferenceBackend()
    g = torch.Generator().manual_seed(2)
    spec = AttentionSpec(4, 2, 16, 0.25)
    k_cache = torch.randn(8, 16, 2, 16, generator=g)
    v_cache = torch.randn(8, 16, 2, 16, generator=g)
    for ql, sl, tables in (([1], [20], [[5, 3]]), ([1, 1], [9, 40], [[1], [6, 0, 7]])):
        meta = build_attention_metadata(ql, sl, tables, 16)
        q, k, v = (torch.randn(len(ql), h, 16, generator=g) for h in (4, 2, 2))
        out = backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, spec)
        expect = ref.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, spec)
        torch.testing.assert_close(out, expect, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_split_kv_with_fully_masked_chunks(dtype: torch.dtype) -> None:
    """A short and a long decode share one split layout: the short one's later chunks
    hold no valid key and must get zero weight in the log-sum-exp merge."""
    seq_lens = [20, 2999]
    out, ref, _, _ = run_both([1, 1], seq_lens, 4, 1, 16, dtype)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    meta = build_attention_metadata([1, 1], seq_lens, [list(range(2)), list(range(2, 190))], 16)
    backend = CPUBackend()
    plan = backend.plan(meta).decode
    assert plan is not None
    from treadle.layers.attention.cpu import _split_layout

    assert _split_layout(plan, 16, 1, None, dtype).num_splits > 1


def test_forward_without_a_plan_equals_planned() -> None:
    """A caller that skips AttentionBackend.plan gets the same result (the plan worked out per call)."""
    g = torch.Generator().manual_seed(7)
    shape = (12, 16, 2, 8)
    caches = [torch.randn(shape, generator=g) for _ in range(2)]
    meta = build_attention_metadata([5, 1, 1], [5, 20, 33], [[0], [1, 2], [3, 4, 5]], 16)
    q, k, v = (torch.randn(7, h, 8, generator=g) for h in (4, 2, 2))
    spec = AttentionSpec(4, 2, 8, 8**-0.5)
    backend = CPUBackend()
    unplanned = backend.forward(q, k, v, *(c.clone() for c in caches), meta, spec)
    meta.plan = backend.plan(meta)
    assert torch.equal(backend.forward(q, k, v, *(c.clone() for c in caches), meta, spec), unplanned)
