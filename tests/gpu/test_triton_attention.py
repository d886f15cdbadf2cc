"""Triton attention kernels against the reference backend, on the CPU via Triton's interpreter.

TRITON_INTERPRET is set by this folder's conftest.
Inputs are small and random; block tables are shuffled (non-contiguous) and sequence
lengths are not multiples of the block size.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from treadle.layers.attention import (
    AttentionMetadata,
    AttentionSpec,
    ReferenceBackend,
    build_attention_metadata,
)
from treadle.layers.attention.triton_backend import TritonBackend, TritonTiles, decode_splits

HEADS = {"mha": (2, 2), "gqa": (6, 2), "mqa": (4, 1)}  # (num_heads, num_kv_heads); GQA group 3
HEAD_DIM = 32
NUM_BLOCKS = 24


@dataclass
class Case:
    q: torch.Tensor  # [T, H, D], a strided view like the model's fused projection
    k: torch.Tensor  # [T, KV, D]
    v: torch.Tensor  # [T, KV, D]
    k_cache: torch.Tensor  # [NUM_BLOCKS, block_size, KV, D], random (stale data everywhere)
    v_cache: torch.Tensor
    meta: AttentionMetadata
    spec: AttentionSpec


def make_case(
    heads: str,
    block_size: int,
    query_lens: list[int],
    seq_lens: list[int],
    *,
    window: int | None = None,
    dtype: torch.dtype = torch.float32,
    head_dim: int = HEAD_DIM,
    seed: int = 0,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = HEADS[heads]
    blocks = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables, used = [], 0
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(blocks[used : used + n])
        used += n
    assert used <= NUM_BLOCKS
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    tokens = sum(query_lens)
    widths = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = torch.randn(tokens, sum(widths), generator=gen).to(dtype)
    q, k, v = qkv.split(widths, dim=-1)
    cache_shape = (NUM_BLOCKS, block_size, num_kv_heads, head_dim)
    return Case(
        q=q.view(tokens, num_heads, head_dim),
        k=k.view(tokens, num_kv_heads, head_dim),
        v=v.view(tokens, num_kv_heads, head_dim),
        k_cache=torch.randn(cache_shape, generator=gen).to(dtype),
        v_cache=torch.randn(cache_shape, generator=gen).to(dtype),
        meta=meta,
        spec=AttentionSpec(num_heads, num_kv_heads, head_dim, head_dim**-0.5, window),
    )


def run_both(case: Case, backend: TritonBackend) -> tuple[torch.Tensor, torch.Tensor]:
    """Run reference and Triton on separate copies of the cache; the caches must end equal."""
    caches = (case.k_cache.clone(), case.v_cache.clone())
    want = ReferenceBackend().forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.spec)
    got = backend.forward(case.q, case.k, case.v, *caches, case.meta, case.spec)
    assert torch.equal(caches[0], case.k_cache) and torch.equal(caches[1], case.v_cache)
    return got, want


SMALL_TILES = TritonTiles(prefill_block_m=16, prefill_block_n=16, decode_block_n=16, num_kv_splits=4)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", ["mha", "gqa", "mqa"])
def test_chunked_prefill_matches_reference(heads: str, block_size: int) -> None:
    # a fresh prompt, a chunk after 21 cached tokens, and a decode token in one mixed batch
    case = make_case(heads, block_size, query_lens=[19, 12, 1], seq_lens=[19, 33, 45])
    got, want = run_both(case, TritonBackend(SMALL_TILES))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", ["mha", "gqa", "mqa"])
def test_split_kv_decode_matches_reference(heads: str, block_size: int, splits: int) -> None:
    tiles = TritonTiles(decode_block_n=16, num_kv_splits=splits)
    case = make_case(heads, block_size, query_lens=[1, 1, 1], seq_lens=[77, 5, 40], seed=splits)
    got, want = run_both(case, TritonBackend(tiles))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_decode_splits_fill_two_programs_per_multiprocessor() -> None:
    """An H200's 132 multiprocessors, 8 KV heads: 32 splits for one row, 8 from 4 rows up."""
    assert [decode_splits(b, 8, 132) for b in (1, 2, 4, 16, 64, 256)] == [32, 16, 8, 8, 8, 8]
    assert decode_splits(1, 1, 132) == 32 and decode_splits(3, 2, 16) == 8


def test_decode_with_the_default_splits_matches_reference() -> None:
    """No num_kv_splits: the split count follows the batch (decode_splits)."""
    case = make_case("gqa", 16, query_lens=[1, 1, 1], seq_lens=[77, 5, 40], seed=11)
    got, want = run_both(case, TritonBackend(TritonTiles(16, 16, 16)))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("query_lens", [[1, 1], [9, 1]], ids=["decode", "prefill"])
def test_sliding_window_matches_reference(query_lens: list[int]) -> None:
    case = make_case("gqa", 16, query_lens=query_lens, seq_lens=[50, 23], window=13, seed=3)
    got, want = run_both(case, TritonBackend(SMALL_TILES))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_prefill_with_tiles_wider_than_blocks_and_odd_head_dim() -> None:
    # head_dim 24 is padded to 32 lanes inside the kernels; key tiles span several blocks
    case = make_case("gqa", 16, query_lens=[40, 3], seq_lens=[40, 70], head_dim=24, seed=5)
    tiles = TritonTiles(prefill_block_m=32, prefill_block_n=64, decode_block_n=64, num_kv_splits=2)
    got, want = run_both(case, TritonBackend(tiles))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_half_precision_matches_reference() -> None:
    case = make_case("gqa", 16, query_lens=[6, 1], seq_lens=[30, 18], dtype=torch.float16, seed=7)
    got, want = run_both(case, TritonBackend(SMALL_TILES))
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-3)


def test_sequence_without_new_tokens_is_left_alone() -> None:
    case = make_case("mha", 16, query_lens=[2, 0, 3], seq_lens=[20, 9, 3], seed=11)
    got, want = run_both(case, TritonBackend(SMALL_TILES))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_padded_decode_rows_attend_to_nothing() -> None:
    """CUDA-graph padding: extra rows with slot -1 and seq_len 0 write nothing, read
    nothing and come out as zeros; the real rows are unaffected."""
    case = make_case("gqa", 16, query_lens=[1, 1], seq_lens=[29, 14], seed=13)
    tables = [row.tolist() for row in case.meta.block_tables]
    padded = build_attention_metadata([1, 1, 1, 1], [29, 14, 1, 1], tables + [[0], [0]], 16)
    padded.seq_lens_tensor[2:] = 0
    padded.slot_mapping[2:] = -1
    extra = torch.randn(2, *case.q.shape[1:])
    q, k, v = (torch.cat([t, extra[:, : t.shape[1]]]) for t in (case.q, case.k, case.v))
    caches = (case.k_cache.clone(), case.v_cache.clone())
    got = TritonBackend(SMALL_TILES).forward(q, k, v, *caches, padded, case.spec)
    want = ReferenceBackend().forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.spec)
    torch.testing.assert_close(got[:2], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[2:], torch.zeros_like(got[2:]))
    assert torch.equal(caches[0], case.k_cache) and torch.equal(caches[1], case.v_cache)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_cache_write_kernel_scatters_and_skips_negative_slots(cache_dtype: torch.dtype) -> None:
    case = make_case("gqa", 16, query_lens=[5, 4], seq_lens=[21, 4], seed=17)
    slots = case.meta.slot_mapping.clone()
    slots[[1, 6]] = -1
    k_cache, v_cache = case.k_cache.to(cache_dtype), case.v_cache.to(cache_dtype)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    TritonBackend().write_kv(case.k, case.v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, 2, HEAD_DIM), v_cache.view(-1, 2, HEAD_DIM)
    keep = slots >= 0
    assert torch.equal(flat_k[slots[keep]], case.k[keep].to(cache_dtype))
    assert torch.equal(flat_v[slots[keep]], case.v[keep].to(cache_dtype))
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots[keep]] = False
    assert torch.equal(flat_k[untouched], before_k.view(-1, 2, HEAD_DIM)[untouched])
    assert torch.equal(flat_v[untouched], before_v.view(-1, 2, HEAD_DIM)[untouched])
    assert not torch.equal(k_cache, before_k)  # something was written


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("query_lens", [[1, 1, 1], [19, 12, 1]], ids=["decode", "mixed"])
def test_quantized_cache_matches_reference(query_lens: list[int], kv_dtype: torch.dtype) -> None:
    """int8 / fp8 caches (kv_quant's packed rows): Triton writes the same bytes the reference
    writes and attends over the same dequantized keys, so the outputs agree to float error."""
    from treadle.layers.attention.kv_quant import quantize

    case = make_case("gqa", 16, query_lens=query_lens, seq_lens=[19, 33, 45], seed=13)
    case.k_cache, case.v_cache = quantize(case.k_cache, kv_dtype), quantize(case.v_cache, kv_dtype)
    caches = (case.k_cache.clone(), case.v_cache.clone())
    want = ReferenceBackend().forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.spec)
    got = TritonBackend(SMALL_TILES).forward(case.q, case.k, case.v, *caches, case.meta, case.spec)
    assert torch.equal(caches[0].view(torch.uint8), case.k_cache.view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), case.v_cache.view(torch.uint8))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
