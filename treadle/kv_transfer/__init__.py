"""Prefill/decode disaggregation: the KV connector contract and its connectors.

    client -> router -> producer (kv_producer): prompt + first token; blocks held; answer
                        carries kv_transfer_params {do_remote_prefill, remote_host/port,
                        remote_tp_size, remote_request_id, num_tokens, ...}
                     -> consumer (kv_consumer): same request + those params; pulls the KV of
                        prompt[:-1], computes the last prompt token itself (its logits give
                        the first output token), decodes

The contract is split as the engine is (guide principle 10):

- scheduler side (``scheduler.py``, torch-free, the ``KVTransferScheduler``'s hooks): how many
  prompt tokens are available remotely, the blocks to allocate for them, the per-step
  ``KVConnectorMetadata`` (``metadata.py``: loads, saves, releases) sent to the workers on the
  ``SchedulerOutput``, and the producer's blocks on finish/abort (held until pulled or
  ``producer_block_timeout_s``, or released at once by a consumer or the router that will not
  pull them, ``release.py``; an aborted request's are freed at once);
- worker side (``worker.py``, ``KVConnectorWorker``): start loading, wait for a layer (layer-wise
  start: the model waits per layer, ``progress.py``), save a layer, finished transfers and failed ones (reported per request in ``KVConnectorOutput`` on
  the ``ModelRunnerOutput``; the scheduler recomputes those prompts).

Tensor parallelism (any sizes on either side): every rank runs the worker side over the KV heads
it holds; producer rank r serves on ``kv_port + r`` and consumer rank c pulls exactly its heads
from the producer ranks that hold them (``heads.py``); the executor merges the ranks' reports
(``aggregate.py``), so the scheduler side reads one report per instance and a load that failed on
any rank is recomputed on all. Pipeline parallelism is refused by the resolver.

Connectors: ``tcp`` (``tcp.py``, ZeroMQ, msgspec headers + raw frames, across machines) and
``shm`` (``shm.py``, shared memory, one host). An RDMA library (NIXL, Mooncake) plugs in as
another ``KVConnectorWorker``: ``start_step`` registers held blocks' memory with the library
(or posts reads into the consumer's LoadSpec blocks), ``get_finished`` polls its completion
queue; nothing above the connector changes, since the scheduler only ever sees block ids,
LoadSpecs and finished/failed request ids. ``create_connector`` below is the one registry.

This ``__init__`` imports nothing, so the torch-free scheduler side stays torch-free.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from treadle.config import KVTransferConfig
    from treadle.kv_transfer.heads import RankPlacement
    from treadle.kv_transfer.worker import KVCaches, KVConnectorWorker


def create_connector(config: KVTransferConfig, kv_caches: KVCaches,
                     placement: RankPlacement | None = None) -> KVConnectorWorker:
    """The worker side of ``config.connector`` over this worker's KV cache; ``placement``:
    this rank's place under tensor parallelism (None: the only rank)."""
    if config.connector == "shm":
        from treadle.kv_transfer.shm import ShmConnector

        return ShmConnector(config, kv_caches, placement)
    from treadle.kv_transfer.tcp import TcpConnector

    return TcpConnector(config, kv_caches, placement)
