"""The ``shm`` connector: instances on one host. The same pull protocol as ``tcp`` (control
over ZeroMQ, checksums, layer by layer), but the KV bytes do not cross a socket: the consumer
creates a shared-memory segment sized for the transfer (one per producer rank it pulls from,
sized for the heads it asks that rank for) and names it in its PullRequest; the producer copies
each layer's blocks straight into it and sends only the LayerHeader; the consumer copies the
layer out into its KV cache. The consumer owns the segments (it unlinks them when the pull
ends, whatever happened), so a dead or slow producer leaks nothing.

    segment layout: [layer][k | v][num_blocks * block bytes of the asked heads]
"""
from __future__ import annotations

import threading
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
import zmq

from treadle.core.kv_connector_data import LoadSpec
from treadle.kv_transfer.heads import HeadSlice
from treadle.kv_transfer.tcp import TcpConnector
from treadle.kv_transfer.wire import LayerHeader, PullRequest, TransferError, check_frame, crc

SHM_DIR = Path("/dev/shm")  # where POSIX shared memory segments live (Linux)


class ShmConnector(TcpConnector):
    _local = threading.local()  # each pull thread's open segments, by name

    def open_target(self, spec: LoadSpec, part: HeadSlice) -> str:
        if not part.num_heads:
            return ""
        size = 2 * self.layout.num_layers * len(spec.local_block_ids) * self.layout.block_bytes(part.num_heads)
        seg = shared_memory.SharedMemory(create=True, size=size)
        self._segments()[seg.name] = seg
        return seg.name

    def close_target(self) -> None:
        segments = self._segments()
        while segments:
            seg = segments.popitem()[1]
            seg.unlink()
            _close(seg)

    def _segments(self) -> dict[str, shared_memory.SharedMemory]:
        if not hasattr(self._local, "segments"):
            self._local.segments = {}
        return self._local.segments  # type: ignore[no-any-return]

    def send_layers(self, sock: zmq.Socket, identity: bytes, req: PullRequest, blocks: list[int]) -> None:
        if not req.shm_name:
            raise TransferError("the shm connector needs the consumer's segment name")
        nbytes = len(blocks) * self.layout.block_bytes(req.num_heads)
        # mapped as a file: attaching with SharedMemory would enrol the segment in this process's
        # resource tracker, which must not unlink what the consumer owns
        dst = np.memmap(SHM_DIR / req.shm_name.lstrip("/"), np.uint8, "r+", shape=(self.layout.num_layers, 2, nbytes))
        try:
            idx = torch.tensor(blocks, dtype=torch.long, device=self.kv[0][0].device)
            for layer, (k, v) in enumerate(self.kv):
                for j, full in enumerate((k, v)):
                    cache = full.narrow(2, req.src_head, req.num_heads)
                    out = torch.from_numpy(dst[layer, j]).view(cache.dtype).view(len(blocks), *cache.shape[1:])
                    if cache.is_cpu:
                        torch.index_select(cache, 0, idx, out=out)
                    else:
                        out.copy_(cache.index_select(0, idx))
                head = LayerHeader(layer, crc(dst[layer, 0].data), crc(dst[layer, 1].data))
                sock.send_multipart([identity, msgspec.msgpack.encode(head)])
        finally:
            del dst

    def receive_layer(self, parts: list[Any], nbytes: int, target: str) -> tuple[int, memoryview, memoryview]:
        head = msgspec.msgpack.decode(parts[0], type=LayerHeader)
        seg = self._segments().get(target)
        buf = None if seg is None else seg.buf
        if len(parts) != 1 or buf is None or not 0 <= head.layer < self.layout.num_layers:
            raise TransferError("malformed layer message")
        at = 2 * head.layer * nbytes
        kb, vb = buf[at : at + nbytes], buf[at + nbytes : at + 2 * nbytes]
        check_frame(kb, head.crc_k, nbytes, f"layer {head.layer} keys")
        check_frame(vb, head.crc_v, nbytes, f"layer {head.layer} values")
        return head.layer, kb, vb


def _close(seg: shared_memory.SharedMemory) -> None:
    """Unmap ``seg``; while a failed transfer's traceback still holds a view of it, leave
    that to the garbage collector."""
    try:
        seg.close()
    except BufferError:
        pass
