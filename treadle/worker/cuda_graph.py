"""CUDA graphs for decode steps: capture once per batch-size bucket, pad, replay.

A decode step launches hundreds of small kernels; replaying a captured graph removes
the per-kernel launch cost. Graphs bake in tensor addresses and shapes, so the runner
owns static input buffers sized for the largest bucket and one graph per bucket::

    buckets  1  2  4  8  16  32 ... max_num_seqs
    step with 5 decode sequences -> bucket 8:
    static rows  | s0 s1 s2 s3 s4 | pad pad pad |
    slot_mapping | real slots     | -1  -1  -1  |   padded rows write nothing
    seq_lens     | real lengths   |  0   0   0  |   ... and read nothing (output 0)

Contract with the model runner::

    runner = maybe_graph_runner(enforce_eager, device, model, kv_caches, max_num_seqs,
                                max_blocks_per_seq, block_size)      # None -> run eagerly
    if runner is not None:
        runner.capture()                   # once, after weights and KV cache exist
    if runner is not None and runner.can_run(meta):
        hidden = runner.run(input_ids, positions, meta)  # [num_tokens, hidden], a view
    else:
        hidden = model(input_ids, positions, kv_caches, meta)

- ``kv_caches`` must be the very tensors every step uses (their addresses are captured).
- The attention backend's decode path must be graph-safe: no host synchronisation and
  only metadata *tensors* read (``TritonBackend`` is; the reference backend is not).
- ``run`` returns a view into the bucket's static output, overwritten by the next
  ``run``: sample from it (or clone it) before the next step.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from treadle.layers.attention.metadata import AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, num_kv_heads, head_dim]
DecodeModel = Callable[[torch.Tensor, torch.Tensor, list[KVCache], AttentionMetadata], torch.Tensor]


def default_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to (and including) max_num_seqs."""
    small = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    return small + list(range(16, max_num_seqs, 16)) + [max_num_seqs]


class CUDAGraphRunner:
    """Captures ``model``'s decode forward for each batch-size bucket and replays it."""

    def __init__(
        self,
        model: DecodeModel,
        kv_caches: list[KVCache],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device | str = "cuda",
        buckets: Sequence[int] | None = None,
    ) -> None:
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.device = torch.device(device)
        self.buckets = sorted(set(buckets or default_buckets(max_num_seqs)))
        n, dev = self.buckets[-1], self.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)  # [n]
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)  # [n]
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)  # [n]
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)  # [n]
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)  # [n + 1]
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> [bucket, hidden] static output

    def _meta(self, size: int) -> AttentionMetadata:
        """Decode metadata over the first ``size`` static rows (host fields are nominal)."""
        max_seq_len = self.block_tables.shape[1] * self.block_size
        return AttentionMetadata(
            query_lens=[1] * size,
            seq_lens=[max_seq_len] * size,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens_tensor=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            block_size=self.block_size,
            max_query_len=1,
            max_seq_len=max_seq_len,
        )

    def forward_staged(self, size: int) -> torch.Tensor:  # [size, hidden_size]
        """Run the model eagerly on the first ``size`` static rows: what the graph of
        bucket ``size`` records and replays (also how the padding is tested on CPU)."""
        meta = self._meta(size)
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up (compiling kernels) and capture every bucket, largest first, sharing
        one memory pool. The static rows are padding (write and read nothing) meanwhile."""
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in self.buckets:
                self.forward_staged(size)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        pool = None
        for size in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.forward_staged(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def can_run(self, meta: AttentionMetadata) -> bool:
        """True for a pure decode step (one new token per sequence) that fits a bucket."""
        return (
            bool(self.graphs)
            and meta.max_query_len == 1
            and meta.num_tokens == meta.num_seqs
            and meta.num_seqs <= self.buckets[-1]
            and meta.block_size == self.block_size
            and meta.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def bucket_for(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,  # [num_seqs]
        positions: torch.Tensor,  # [num_seqs]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_seqs, hidden_size], a view into the static output
        size = self.stage(input_ids, positions, meta)
        self.graphs[size].replay()
        return self.outputs[size][: meta.num_seqs]

    def stage(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> int:
        """Copy a decode step into the static rows, pad it to its bucket; returns the bucket."""
        n = meta.num_seqs
        size = self.bucket_for(n)
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens_tensor, non_blocking=True)
        self.seq_lens[n:size].zero_()
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        return size


def maybe_graph_runner(
    enforce_eager: bool,
    device: torch.device | str,
    model: DecodeModel,
    kv_caches: list[KVCache],
    max_num_seqs: int,
    max_blocks_per_seq: int,
    block_size: int,
) -> CUDAGraphRunner | None:
    """A graph runner on CUDA unless ``enforce_eager`` (``--enforce-eager``); else None."""
    if enforce_eager or torch.device(device).type != "cuda":
        return None
    return CUDAGraphRunner(model, kv_caches, max_num_seqs, max_blocks_per_seq, block_size, device)
