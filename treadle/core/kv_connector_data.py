"""Plain data of the KV connector contract (torch-free): what the scheduler side sends the
worker side each step (``KVConnectorMetadata``, on ``SchedulerOutput``), what comes back
(``KVConnectorOutput``, on ``ModelRunnerOutput``), and the ``kv_transfer_params`` a producer
hands out and a consumer receives (vLLM's names)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LoadSpec:
    """Consumer: pull the KV of the first ``num_tokens`` tokens of the remote request into
    ``local_block_ids`` (the remote blocks cover exactly as many tokens). The producer's rank
    r serves on ``remote_port + r`` (``remote_tp_size`` ranks)."""

    request_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    num_tokens: int
    local_block_ids: list[int]
    remote_tp_size: int = 1


@dataclass
class RemoteRelease:
    """Consumer: ``request_id`` will not use (or stopped using) the KV the producer at
    ``remote_host:remote_port`` holds for ``remote_request_id`` (aborted before its pull
    finished, or its load failed): the producer may free it now, and a pull of ``request_id``
    still in flight here is cancelled."""

    request_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_tp_size: int = 1  # the producer's ranks serve on remote_port + r: each gets the release


@dataclass
class KVConnectorMetadata:
    """Scheduler side -> worker side, once per step, before the step runs."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: dict[str, list[int]] = field(default_factory=dict)  # producer: request id -> held block ids
    releases: list[str] = field(default_factory=list)  # producer: stop serving these (blocks freed after)
    remote_releases: list[RemoteRelease] = field(default_factory=list)  # consumer: tell producers to free
    # consumer, layer-wise start: requests of this step whose loads are still landing; the model waits
    # for each layer of their KV before running that layer (``KVConnectorWorker.wait_for_layer_load``)
    streaming: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.releases or self.remote_releases or self.streaming)


@dataclass
class KVConnectorOutput:
    """Worker side -> scheduler side, after each step: transfers that ended since the last one."""

    started_loading: list[str] = field(default_factory=list)  # the producer answered; layers are on the wire
    finished_loading: list[str] = field(default_factory=list)
    failed_loading: dict[str, str] = field(default_factory=dict)  # request id -> why (its blocks are recomputed)
    finished_sending: list[str] = field(default_factory=list)  # producer: pulled (or released here); the blocks may be freed
    released_unpulled: list[str] = field(default_factory=list)  # producer: a consumer / router let go; free
    num_bytes_received: int = 0


MAX_REMOTE_TP_SIZE = 256  # the params come from a request body: bounds the producer ranks a pull contacts


@dataclass(frozen=True)
class RemotePrefill:
    """A consumer's reading of ``kv_transfer_params`` with ``do_remote_prefill``."""

    engine_id: str
    host: str
    port: int
    request_id: str
    num_tokens: int  # prompt tokens whose KV the producer holds
    tp_size: int = 1  # the producer's tensor-parallel size (rank r serves on port + r)

    @staticmethod
    def parse(params: dict[str, Any] | None) -> RemotePrefill | None:
        """None unless ``params`` asks for a remote prefill and names a reachable producer;
        a malformed one is also None (the consumer then computes the prompt itself)."""
        if not params or not params.get("do_remote_prefill"):
            return None
        try:
            remote = RemotePrefill(str(params["remote_engine_id"]), str(params["remote_host"]),
                                   int(params["remote_port"]), str(params["remote_request_id"]),
                                   int(params["num_tokens"]), int(params.get("remote_tp_size", 1)))
        except (KeyError, TypeError, ValueError):
            return None
        return remote if 1 <= remote.tp_size <= MAX_REMOTE_TP_SIZE else None


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    return bool(params and params.get("do_remote_decode"))
