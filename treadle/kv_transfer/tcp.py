"""The ``tcp`` connector: consumers pull held KV from producers over ZeroMQ (works across
machines). Control messages are msgspec (``wire.py``); KV travels as raw frames, one message
per layer, so the consumer writes layer i into its blocks while later layers are in flight.

Producer: each tensor-parallel rank r has one ROUTER socket on ``kv_ip:kv_port + r`` served
by a thread. A pull for a request not yet servable (its save arrives with the next step) is
parked for up to PARK_S; one for a released or unknown request is refused. Serving copies, under
the lock that ``start_step``'s releases take, each layer's blocks (the asked slice of this
rank's heads) out and sends them. Once every consumer rank that pulls from this rank
(``heads.py``) has pulled, the request leaves the servable table and is reported sent (its
blocks may be freed: the frames are copies); a request released before that is reported too,
so every rank reports every held request once (the executor merges the ranks' reports). A
release message (``release.py``, from a consumer or the router, sent to every rank) stops
serving its requests and reports them ``released_unpulled``; one that comes before the
request's save drops the save when it comes.

Consumer: each LoadSpec is pulled on a small thread pool: one DEALER socket per producer rank
this rank pulls from (``heads.py``), all asked at once, layer i read from each before layer
i + 1, one deadline (``transfer_timeout_s``) for the whole transfer; every frame's length and
checksum and the header's layout are checked before the layer is written. Once every producer
rank answered, the load is reported ``started``; each layer, once written from every rank, is
marked landed (``progress.py``: layer-wise start waits on it). A pull whose request is aborted
meanwhile (``remote_releases``) stops at its next wait, and the producer is sent a release.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import torch
import zmq

from treadle.config import KVTransferConfig
from treadle.core.kv_connector_data import KVConnectorMetadata, KVConnectorOutput, LoadSpec
from treadle.kv_transfer.heads import HeadSlice, RankPlacement, check_tp_size, num_pullers, pull_plan
from treadle.kv_transfer.progress import LoadProgress
from treadle.kv_transfer.release import decode_release, send_release
from treadle.kv_transfer.wire import (
    KVLayout,
    LayerHeader,
    PullHeader,
    PullRequest,
    TransferError,
    check_frame,
    crc,
)
from treadle.kv_transfer.worker import KVCaches, KVConnectorWorker

logger = logging.getLogger("treadle")

PARK_S = 2.0  # how long a pull may wait for its request to become servable
POLL_MS = 20


class TcpConnector(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, kv_caches: KVCaches, placement: RankPlacement | None = None) -> None:
        self.config, self.kv = config, kv_caches
        self.placement = placement or RankPlacement.single(kv_caches[0][0].shape[2])
        self.layout = KVLayout.of(kv_caches, self.placement.num_kv_heads)  # the model's heads: same on every rank
        self.ctx = zmq.Context()
        self._lock = threading.Lock()  # guards _servable, _pulled and every read of held blocks
        self._servable: dict[str, list[int]] = {}
        self._pulled: dict[str, set[int]] = {}  # servable request -> consumer ranks that pulled it
        self._released: deque[str] = deque(maxlen=4096)
        self._pulls = LoadProgress()  # consumer: pulls in flight, their landed layers and cancel flags
        self._streaming: list[str] = []  # consumer: this step's requests whose KV may still be arriving
        self._ended: queue.SimpleQueue[tuple[str, str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._enc = msgspec.msgpack.Encoder()
        self._server: threading.Thread | None = None
        if config.is_producer:
            sock = self.ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(f"tcp://{config.ip}:{config.port + self.placement.tp_rank}")
            self._server = threading.Thread(target=self._serve, args=(sock,), name="kv-serve", daemon=True)
            self._server.start()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="kv-pull") if config.is_consumer else None

    # -- the step thread -------------------------------------------------------------------
    def start_step(self, meta: KVConnectorMetadata | None) -> None:
        if meta is None:
            return
        with self._lock:
            for rid, blocks in meta.saves.items():
                if rid in self._released:  # a consumer or the router released it first
                    self._end("released", rid, None)
                else:
                    self._servable[rid] = blocks
            for rid in meta.releases:
                self._released.append(rid)
                self._pulled.pop(rid, None)
                if self._servable.pop(rid, None) is not None:
                    self._end("sent", rid, None)  # never fully pulled: this rank is done with it too
        for rel in meta.remote_releases:
            cancel = self._pulls.cancel_flag(rel.request_id)
            if cancel is not None:
                cancel.set()
            if self.placement.tp_rank == 0:  # one rank tells every producer rank
                send_release(self.ctx, rel.remote_host, rel.remote_port, [rel.remote_request_id], rel.remote_tp_size)
        for spec in meta.loads:
            if self._pool is None:
                self._end("failed", spec.request_id, "this instance is not a kv_consumer")
            else:
                self._pulls.start(spec.request_id, self.config.transfer_timeout_s)
                self._pool.submit(self._pull, spec)
        self._streaming = list(meta.streaming)

    def wait_for_layer_load(self, layer: int) -> None:
        for rid in self._pulls.wait(self._streaming, layer):
            logger.warning("request %s: layer %d of its KV did not arrive; its step is discarded", rid, layer)
            self._streaming.remove(rid)

    def get_finished(self, wait_s: float = 0.0) -> KVConnectorOutput | None:
        if self._streaming:  # the model waited for all their layers: let them report how they ended
            self._pulls.wait_ended(self._streaming)
            self._streaming = []
        if wait_s > 0 and self._ended.empty():
            self._wake.wait(wait_s)
        self._wake.clear()
        out = KVConnectorOutput()
        ended = False
        while True:
            try:
                kind, rid, value = self._ended.get_nowait()
            except queue.Empty:
                break
            ended = True
            if kind == "loaded":
                out.finished_loading.append(rid)
                out.num_bytes_received += value
            elif kind == "failed":
                out.failed_loading[rid] = value
            elif kind == "started":
                out.started_loading.append(rid)
            elif kind == "released":
                out.released_unpulled.append(rid)
            else:
                out.finished_sending.append(rid)
        return out if ended else None

    def shutdown(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._server is not None:
            self._server.join(2)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self.ctx.destroy(linger=0)

    def _end(self, kind: str, rid: str, value: Any) -> None:
        self._ended.put((kind, rid, value))
        self._wake.set()

    # -- producer: the serving thread --------------------------------------------------------
    def _serve(self, sock: zmq.Socket) -> None:
        decoder = msgspec.msgpack.Decoder(PullRequest)
        parked: list[tuple[bytes, PullRequest, float]] = []
        try:
            while not self._stop.is_set():
                if sock.poll(POLL_MS):
                    parts = sock.recv_multipart()
                    released = decode_release(parts)
                    if released is not None:
                        self._release_remote(released)
                        continue
                    identity, frame = parts[:2]
                    try:
                        parked.append((identity, decoder.decode(frame), time.monotonic() + PARK_S))
                    except msgspec.DecodeError:
                        sock.send_multipart([identity, self._enc.encode(PullHeader(False, "unreadable request"))])
                parked = [p for p in parked if not self._try_serve(sock, *p)]
        finally:
            sock.close(0)

    def _release_remote(self, request_ids: list[str]) -> None:
        """A release message: stop serving these (a pull parked for one is then refused)."""
        with self._lock:
            for rid in request_ids:
                if rid in self._released:
                    continue
                self._released.append(rid)
                self._pulled.pop(rid, None)
                if self._servable.pop(rid, None) is not None:
                    self._end("released", rid, None)

    def _try_serve(self, sock: zmq.Socket, identity: bytes, req: PullRequest, park_until: float) -> bool:
        """Serve ``req`` if it can be; True when it is answered (served or refused)."""
        with self._lock:
            blocks = self._servable.get(req.request_id)
            if blocks is None:
                if req.request_id in self._released or time.monotonic() > park_until:
                    sock.send_multipart([identity, self._enc.encode(
                        PullHeader(False, f"request {req.request_id!r} is not held here (expired or unknown)"))])
                    return True
                return False
            error = self._check(req, blocks)
            if error:
                sock.send_multipart([identity, self._enc.encode(PullHeader(False, error))])
                return True  # still held: a well-formed pull may come
            done = self._count_pull(req)
            sock.send_multipart([identity, self._enc.encode(PullHeader(True, "", self.layout, req.num_blocks))])
            try:
                if req.num_heads:
                    self.send_layers(sock, identity, req, blocks[: req.num_blocks])
            except Exception as e:  # noqa: BLE001 - a broken pull must not stop the server
                logger.warning("serving KV of %s failed: %r", req.request_id, e)
        if done:
            self._end("sent", req.request_id, None)
        return True

    def _count_pull(self, req: PullRequest) -> bool:
        """Note ``req``'s consumer rank as served (under the lock); True once every consumer
        rank that pulls from this rank has: the request is then no longer servable."""
        pulled = self._pulled.setdefault(req.request_id, set())
        pulled.add(req.consumer_rank)
        me = self.placement
        if len(pulled) < num_pullers(me.num_kv_heads, me.tp_size, req.consumer_tp, me.tp_rank):
            return False
        del self._servable[req.request_id], self._pulled[req.request_id]
        return True

    def _check(self, req: PullRequest, blocks: list[int]) -> str:
        me = self.placement
        if req.layout != self.layout:
            return f"KV layout mismatch: producer {self.layout}, consumer {req.layout}"
        if not 0 < req.num_blocks <= len(blocks):
            return f"asked for {req.num_blocks} blocks, {len(blocks)} held"
        if req.producer_tp != me.tp_size:
            return f"the consumer expects tensor-parallel size {req.producer_tp}, the producer has {me.tp_size}"
        try:
            check_tp_size(me.num_kv_heads, req.consumer_tp)
        except TransferError as e:
            return str(e)
        if not (0 <= req.consumer_rank < req.consumer_tp and 0 <= req.src_head
                and req.num_heads >= 0 and req.src_head + req.num_heads <= self.kv[0][0].shape[2]):
            return f"heads {req.src_head}+{req.num_heads} for rank {req.consumer_rank}/{req.consumer_tp} are not held here"
        return ""

    def send_layers(self, sock: zmq.Socket, identity: bytes, req: PullRequest, blocks: list[int]) -> None:
        """The data path: each layer's blocks as two raw frames after a LayerHeader."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.kv[0][0].device)
        for layer, (k, v) in enumerate(self.kv):
            kb, vb = (_raw(t.narrow(2, req.src_head, req.num_heads), idx) for t in (k, v))
            head = self._enc.encode(LayerHeader(layer, crc(kb), crc(vb)))
            sock.send_multipart([identity, head, kb, vb], copy=False)

    # -- consumer: a pull ----------------------------------------------------------------------
    def _pull(self, spec: LoadSpec) -> None:
        try:
            self._end("loaded", spec.request_id, self._transfer(spec))
        except Exception as e:  # noqa: BLE001 - any failure means: recompute
            self._end("failed", spec.request_id, f"{type(e).__name__}: {e}")
        finally:
            self._pulls.ended(spec.request_id)

    def _transfer(self, spec: LoadSpec) -> int:
        deadline = time.monotonic() + self.config.transfer_timeout_s
        cancel = self._pulls.cancel_flag(spec.request_id) or threading.Event()
        me, n = self.placement, len(spec.local_block_ids)
        plan = pull_plan(me.num_kv_heads, spec.remote_tp_size, me.tp_size)[me.tp_rank]
        pulls: list[tuple[zmq.Socket, HeadSlice, str]] = []
        try:
            for part in plan:  # every producer rank is asked at once
                target = self.open_target(spec, part)
                sock = self.ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                pulls.append((sock, part, target))
                sock.connect(f"tcp://{spec.remote_host}:{spec.remote_port + part.producer_rank}")
                sock.send(self._enc.encode(PullRequest(
                    spec.remote_request_id, self.layout, n, target, spec.remote_tp_size, me.tp_size,
                    me.tp_rank, part.src_head, part.num_heads)))
            for sock, _, _ in pulls:
                head = msgspec.msgpack.decode(_recv(sock, deadline, cancel)[0], type=PullHeader)
                if not head.ok:
                    raise TransferError(head.error)
                if head.layout != self.layout or head.num_blocks != n:
                    raise TransferError(f"the producer sent {head.num_blocks} blocks of {head.layout}")
            self._end("started", spec.request_id, None)
            idx = torch.tensor(spec.local_block_ids, dtype=torch.long, device=self.kv[0][0].device)
            moving = [p for p in pulls if p[1].num_heads]
            for layer in range(self.layout.num_layers):  # layer by layer, written as each arrives
                for sock, part, target in moving:
                    nbytes = n * self.layout.block_bytes(part.num_heads)
                    layer = self._write_layer(idx, part, *self.receive_layer(_recv(sock, deadline, cancel), nbytes,
                                                                             target))
                self._pulls.landed(spec.request_id, layer)
            return 2 * self.layout.num_layers * n * sum(self.layout.block_bytes(p.num_heads) for p in plan)
        finally:
            for sock, _, _ in pulls:
                sock.close(0)
            self.close_target()

    def _write_layer(self, idx: torch.Tensor, part: HeadSlice, layer: int, kb: memoryview, vb: memoryview) -> int:
        """Copy one layer's received blocks (``part``'s heads) into the cache (keeps no view of
        the buffers); the layer."""
        with torch.no_grad():
            for cache, data in zip(self.kv[layer], (kb, vb)):
                heads = cache.narrow(2, part.dst_head, part.num_heads)
                heads.index_copy_(0, idx, _tensor(data, self.layout, len(idx), part.num_heads).to(cache.device))
        return layer

    def open_target(self, spec: LoadSpec, part: HeadSlice) -> str:
        """Where the producer writes ``part`` (shm: a segment's name); tcp: in the frames ("")."""
        return ""

    def close_target(self) -> None:
        """Release what ``open_target`` made for this pull."""

    def receive_layer(self, parts: list[Any], nbytes: int, target: str) -> tuple[int, memoryview, memoryview]:
        head = msgspec.msgpack.decode(parts[0], type=LayerHeader)
        if len(parts) != 3 or not 0 <= head.layer < self.layout.num_layers:
            raise TransferError("malformed layer message")
        kb, vb = parts[1].buffer, parts[2].buffer
        check_frame(kb, head.crc_k, nbytes, f"layer {head.layer} keys")
        check_frame(vb, head.crc_v, nbytes, f"layer {head.layer} values")
        return head.layer, kb, vb


def _recv(sock: zmq.Socket, deadline: float, cancel: threading.Event) -> list[Any]:
    """The next message, polled in slices so that a cancelled pull stops within POLL_MS."""
    while not cancel.is_set() and not sock.poll(POLL_MS):
        if time.monotonic() >= deadline:
            raise TransferError("timed out waiting for the producer")
    if cancel.is_set():
        raise TransferError("cancelled (the request was aborted, or the model stopped waiting for it)")
    return sock.recv_multipart(copy=False)


def _raw(t: torch.Tensor, idx: torch.Tensor) -> Any:
    """The blocks ``idx`` of ``t`` (a view: one rank's slice of heads) copied out, as one flat
    byte array."""
    return t.index_select(0, idx).contiguous().cpu().view(torch.uint8).reshape(-1).numpy()


def _tensor(data: memoryview, layout: KVLayout, num_blocks: int, num_heads: int) -> torch.Tensor:
    with warnings.catch_warnings():  # read-only buffer: the tensor is only copied from
        warnings.simplefilter("ignore")
        flat = torch.frombuffer(data, dtype=layout.torch_dtype)
    return flat.view(num_blocks, layout.block_size, num_heads, layout.head_dim)
