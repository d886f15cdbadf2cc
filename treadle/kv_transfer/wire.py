"""The pull protocol's messages (msgspec over ZeroMQ DEALER -> ROUTER) and the frame checks.

    consumer DEALER                          producer ROUTER
      PullRequest(id, layout, num_blocks, shm) ->
                                             <- PullHeader(ok | error, layout, num_blocks)
                                             <- per layer: [LayerHeader(layer, crc k, crc v), k, v]
                                                (shm: the bytes sit in the consumer's segment;
                                                 only the LayerHeader travels)
"""
from __future__ import annotations

import zlib

import msgspec
import torch


class KVLayout(msgspec.Struct, frozen=True, array_like=True):
    """What both ends must agree on, else the transfer fails (and the prompt is recomputed)."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32", "bfloat16", ...

    @staticmethod
    def of(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> KVLayout:
        k = kv_caches[0][0]
        return KVLayout(len(kv_caches), k.shape[1], k.shape[2], k.shape[3], str(k.dtype).removeprefix("torch."))

    def block_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_dim * torch.empty(0, dtype=self.torch_dtype).element_size()

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


class PullRequest(msgspec.Struct, array_like=True):
    request_id: str  # the producer's request id (remote_request_id)
    layout: KVLayout
    num_blocks: int  # the first num_blocks held blocks
    shm_name: str = ""  # shm connector: the consumer's segment the producer writes into


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
