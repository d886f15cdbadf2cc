"""The pull protocol's messages (msgspec over ZeroMQ DEALER -> ROUTER) and the frame checks.

    consumer DEALER                          producer ROUTER
      PullRequest(id, layout, num_blocks, shm,
                  tensor-parallel sizes, consumer
                  rank, head slice)          ->
                                             <- PullHeader(ok | error, layout, num_blocks)
                                             <- per layer: [LayerHeader(layer, crc k, crc v), k, v]
                                                (k, v: the blocks' slice of the asked heads;
                                                 shm: the bytes sit in the consumer's segment,
                                                 only the LayerHeader travels; an empty pull,
                                                 0 heads, gets the PullHeader only)
"""
from __future__ import annotations

import zlib

import msgspec
import torch


class KVLayout(msgspec.Struct, frozen=True, array_like=True):
    """What both ends must agree on, else the transfer fails (and the prompt is recomputed)."""

    num_layers: int
    block_size: int
    num_kv_heads: int  # the model's, all tensor-parallel ranks together
    head_dim: int  # the stored width (a quantized cache adds its scales)
    dtype: str  # "float32", "bfloat16", ...

    @staticmethod
    def of(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_kv_heads: int | None = None) -> KVLayout:
        """``num_kv_heads``: the model's (default: the heads this cache holds, one rank)."""
        k = kv_caches[0][0]
        return KVLayout(len(kv_caches), k.shape[1], num_kv_heads or k.shape[2], k.shape[3],
                        str(k.dtype).removeprefix("torch."))

    def block_bytes(self, num_heads: int | None = None) -> int:
        """Bytes of one block of ``num_heads`` heads (default: all of the model's)."""
        heads = self.num_kv_heads if num_heads is None else num_heads
        return self.block_size * heads * self.head_dim * torch.empty(0, dtype=self.torch_dtype).element_size()

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


class PullRequest(msgspec.Struct, array_like=True):
    request_id: str  # the producer's request id (remote_request_id)
    layout: KVLayout
    num_blocks: int  # the first num_blocks held blocks
    shm_name: str = ""  # shm connector: the consumer's segment the producer writes into
    producer_tp: int = 1  # the producer's tensor-parallel size, as the consumer read it
    consumer_tp: int = 1  # the consumer's tensor-parallel size and the pulling rank
    consumer_rank: int = 0
    src_head: int = 0  # the slice of the producer rank's heads to send (heads.py); 0 heads: empty
    num_heads: int = 0


class PullHeader(msgspec.Struct, array_like=True):
    ok: bool
    error: str = ""
    layout: KVLayout | None = None
    num_blocks: int = 0


class LayerHeader(msgspec.Struct, array_like=True):
    layer: int
    crc_k: int
    crc_v: int


class TransferError(Exception):
    """A pull failed: unknown request, layout or shape mismatch, corrupt frame, timeout."""


def crc(data: memoryview | bytes) -> int:
    return zlib.crc32(data)


def check_frame(data: memoryview | bytes, expected_crc: int, expected_len: int, what: str) -> None:
    """Raise TransferError unless ``data`` has the expected length and checksum."""
    if len(data) != expected_len:
        raise TransferError(f"{what}: {len(data)} bytes, expected {expected_len}")
    if crc(data) != expected_crc:
        raise TransferError(f"{what}: checksum mismatch (corrupt frame)")
