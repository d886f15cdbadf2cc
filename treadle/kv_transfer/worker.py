"""The worker side of the KV connector contract: what a connector does with the KV cache.

    Worker.execute(sched):
        connector.start_step(sched.kv_connector_metadata)  # start loads, serve / stop serving blocks
        runner.execute(sched, hook)  # hook = wait_for_layer_load when meta.streaming (layer-wise
                                     # start): the model calls it before each layer runs
        output.kv_connector_output = connector.get_finished(wait_s)   # transfers that ended

Every method runs on the worker's step thread; a connector does its transfers on its own
threads and touches only the blocks the scheduler side named (loads write into a consumer's
freshly allocated blocks, sends read a producer's held ones), so the model may run other
requests meanwhile. A block named in a LoadSpec is written only until the load is reported
finished or failed; a held block is read only until it is reported sent or released.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from treadle.core.kv_connector_data import KVConnectorMetadata, KVConnectorOutput

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v): [num_blocks, block_size, kv_heads, head_dim]


class KVConnectorWorker(ABC):
    @abstractmethod
    def start_step(self, meta: KVConnectorMetadata | None) -> None:
        """Before a step runs: start the loads of ``meta.loads`` (non-blocking: each lands in
        its local blocks layer by layer), make ``meta.saves`` servable, and stop serving
        ``meta.releases`` (returning only once no send reads their blocks any more, since the
        scheduler side reuses them from the next step on)."""

    def wait_for_layer_load(self, layer: int) -> None:  # noqa: B027 - optional hook
        """Layer-wise start: block until every load of this step's ``meta.streaming`` requests
        has written ``layer``. A load that fails first, or misses its deadline
        (``transfer_timeout_s``), is cancelled and its pull stopped before this returns (no write
        into its blocks after the step), and it is reported failed by ``get_finished``: the
        scheduler side then discards that request's step output and recomputes its prompt.
        Called only on steps with streaming requests; the default (no layer-wise) does nothing."""

    @abstractmethod
    def get_finished(self, wait_s: float = 0.0) -> KVConnectorOutput | None:
        """Transfers that ended since the last call: loads finished or failed (with why: the
        scheduler side recomputes those prompts), held blocks sent. ``wait_s`` > 0 (an idle
        step): wait up to that long for one to end. None when nothing ended."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop serving and loading; idempotent."""
