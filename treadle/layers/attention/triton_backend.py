"""Triton attention backend: paged KV cache, FlashAttention prefill, FlashDecoding decode.

Same contract as ``ReferenceBackend`` (write K/V at ``slot_mapping``, slots < 0 skipped;
causal attention over cached + new tokens; sliding window honoured). The kernels live in
``triton_kernels``, which is imported when the backend is built, so the rest of the engine
imports without triton. Under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors.

The decode path (``meta.max_query_len == 1``) reads only the metadata *tensors* and tensor
shapes, never host lists or values: no host synchronisation and a grid that depends only
on the batch size, so it can be captured in a CUDA graph (see ``treadle.worker.cuda_graph``).

A quantized cache (``kv_quant``: int8 / fp8 rows with a float32 scale each) is written by
quantizing in torch and copying the packed bytes with the same store kernel; the attention
kernels read it as bytes (``KV_QUANT``) and dequantize each tile. A prompt chunk's own keys,
which prefill reads from ``k``/``v`` rather than the cache, are rounded through the
quantizer first, so every key is read as the cache holds it (as the reference does).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from types import ModuleType

import torch

from treadle.config import TreadleError
from treadle.layers.attention.backend import AttentionBackend, AttentionSpec
from treadle.layers.attention.kv_quant import dequantize, is_quantized, quantize
from treadle.layers.attention.metadata import AttentionMetadata

_NO_WINDOW = 1 << 30  # larger than any context: "every earlier key is in the window"
_KV_QUANT = {torch.int8: 1, torch.float8_e4m3fn: 2}  # the kernels' KV_QUANT code of a quantized cache


def _cache_args(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor | int, ...]:
    """(k cache, v cache, k scales, v scales, KV_QUANT) as the attention kernels take them:
    a quantized cache as bytes plus a float32 view of the same memory for the scales."""
    code = _KV_QUANT.get(k_cache.dtype, 0)
    if code == 0:
        return k_cache, v_cache, k_cache, v_cache, code
    as_bytes = torch.int8 if code == 1 else torch.uint8  # fp8 bytes are decoded in the kernel
    kb, vb = k_cache.view(as_bytes), v_cache.view(as_bytes)
    return kb, vb, kb.view(torch.float32), vb.view(torch.float32), code


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


@dataclass(frozen=True)
class TritonTiles:
    """Tile sizes and the decode split count; each is a compile-time constant. On a GPU
    every tile must be at least 16 (tl.dot's minimum); the interpreter takes any power of 2."""

    prefill_block_m: int = 64  # new tokens per prefill program
    prefill_block_n: int = 64  # keys per inner-loop tile
    decode_block_n: int = 64
    num_kv_splits: int | None = None  # FlashDecoding splits of each context; None: ``decode_splits``

    @staticmethod
    def default_for(dtype: torch.dtype) -> TritonTiles:
        """64-wide tiles for 16-bit inputs; 32-wide for fp32, whose tiles take twice the
        shared memory (64x64 fp32 prefill needs ~180 KB: more than an A100 has)."""
        if dtype == torch.float32:
            return TritonTiles(prefill_block_m=32, prefill_block_n=32, decode_block_n=32)
        return TritonTiles()


def decode_splits(num_seqs: int, num_kv_heads: int, multiprocessors: int) -> int:
    """FlashDecoding splits of each context for a decode launch of ``num_seqs`` rows: enough
    programs (rows x KV heads x splits) for two per multiprocessor, a power of 2 in [8, 32]. It
    depends on the batch size alone, so each CUDA-graph bucket captures one grid. Measured on an
    H200 (132 SMs; 8 KV heads, head_dim 128, fp16; ``benchmarks/gpu_check.py --splits 8 16 32``):
    1 row x 8192 keys 22 -> 17 us at 32 splits (16 before), 64 rows x 512 keys 87 -> 67 us at 8."""
    want = 2 * multiprocessors // max(1, num_seqs * num_kv_heads)
    return min(32, max(8, 1 << max(0, want.bit_length() - 1)))


@cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 128  # Triton's interpreter: any grid runs; this gives the GPU's mid-sized splits
    return torch.cuda.get_device_properties(device).multi_processor_count


def load_kernels() -> ModuleType:
    """Import the kernel module (and so triton); a clear error if triton is missing."""
    try:
        from treadle.layers.attention import triton_kernels
    except ImportError as exc:
        raise TreadleError(f"the triton attention backend needs triton ({exc}); pip install triton") from None
    return triton_kernels


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self, tiles: TritonTiles | None = None) -> None:
        """``tiles`` None: ``TritonTiles.default_for`` the dtype of each call's queries."""
        if tiles is not None and tiles.num_kv_splits is not None and tiles.num_kv_splits < 1:
            raise TreadleError("num_kv_splits must be at least 1")
        self.tiles = tiles
        self._k = load_kernels()

    def _tiles(self, dtype: torch.dtype) -> TritonTiles:
        return self.tiles or TritonTiles.default_for(dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, spec: AttentionSpec) -> torch.Tensor:
        if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
            raise TreadleError("triton backend: k/v caches must share strides with unit stride on head_dim")
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        self.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if out.shape[0] == 0:
            return out
        if meta.max_query_len == 1:
            self._decode(q, k_cache, v_cache, out, meta, spec)
        else:
            self._prefill(q, k, v, k_cache, v_cache, out, meta, spec)
        return out

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        if k.shape[0] == 0:
            return
        if is_quantized(k_cache):  # packed rows (values + scale), copied as bytes
            k, v = quantize(k, k_cache.dtype).view(torch.uint8), quantize(v, v_cache.dtype).view(torch.uint8)
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        num_tokens, num_kv_heads, head_dim = k.shape
        self._k.store_kv_kernel[(num_tokens,)](
            k, v, k_cache, v_cache, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            k_cache.shape[1], num_kv_heads, head_dim,
            BLOCK_H=_pow2(num_kv_heads), BLOCK_D=_pow2(head_dim),
        )

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, out: torch.Tensor, meta: AttentionMetadata, spec: AttentionSpec) -> None:
        tiles = self._tiles(q.dtype)
        block_m = tiles.prefill_block_m
        num_seqs = meta.seq_lens_tensor.shape[0]
        grid = (num_seqs, spec.num_heads, (meta.max_query_len + block_m - 1) // block_m)
        if is_quantized(k_cache):  # the chunk's own keys as the cache holds them
            k, v = dequantize(quantize(k, k_cache.dtype), q.dtype), dequantize(quantize(v, v_cache.dtype), q.dtype)
        *caches, kv_quant = _cache_args(k_cache, v_cache)
        self._k.prefill_kernel[grid](
            q, k, v, *caches, out,
            meta.block_tables, meta.seq_lens_tensor, meta.query_start_loc,
            spec.scale, spec.sliding_window or _NO_WINDOW,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
            k_cache.shape[1], spec.head_dim, spec.num_heads // spec.num_kv_heads,
            BLOCK_M=block_m, BLOCK_N=tiles.prefill_block_n, BLOCK_D=_pow2(spec.head_dim, 16),
            IEEE=q.dtype == torch.float32, KV_QUANT=kv_quant,
        )

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                meta: AttentionMetadata, spec: AttentionSpec) -> None:
        tiles = self._tiles(q.dtype)
        num_seqs = meta.seq_lens_tensor.shape[0]
        splits = tiles.num_kv_splits or decode_splits(num_seqs, spec.num_kv_heads, _multiprocessors(q.device))
        group = spec.num_heads // spec.num_kv_heads
        block_d = _pow2(spec.head_dim, 16)
        # partial numerators [S, H, splits, D] and (max, denominator) pairs [S, H, splits, 2]
        part_acc = torch.empty((num_seqs, spec.num_heads, splits, spec.head_dim), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((num_seqs, spec.num_heads, splits, 2), dtype=torch.float32, device=q.device)
        *caches, kv_quant = _cache_args(k_cache, v_cache)  # strides: elements of 1 byte when quantized
        self._k.decode_split_kernel[(num_seqs, spec.num_kv_heads, splits)](
            q, *caches, meta.block_tables, meta.seq_lens_tensor, meta.query_start_loc,
            part_acc, part_ml,
            spec.scale, spec.sliding_window or _NO_WINDOW,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            meta.block_tables.stride(0),
            k_cache.shape[1], spec.head_dim, group, spec.num_heads,
            NUM_SPLITS=splits, BLOCK_G=_pow2(group, 16), BLOCK_N=tiles.decode_block_n, BLOCK_D=block_d,
            IEEE=q.dtype == torch.float32, KV_QUANT=kv_quant,
        )
        self._k.decode_reduce_kernel[(num_seqs, spec.num_heads)](
            part_acc, part_ml, out, meta.query_start_loc,
            out.stride(0), out.stride(1), spec.head_dim, spec.num_heads,
            NUM_SPLITS=splits, BLOCK_S=_pow2(splits), BLOCK_D=block_d,
        )
