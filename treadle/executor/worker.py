"""A Worker: one rank's model, KV cache and ModelRunner, built from the resolved EngineConfig.

The same class runs in the engine's process (UniProcExecutor) and in each worker process
(MultiprocExecutor, via ``worker_proc``). In-process it is handed the ModelSource the
resolver already opened; in a worker process it opens ``config.load.model_path`` itself.
"""
from __future__ import annotations

import torch

from treadle.config import EngineConfig, InvalidRequestError
from treadle.core.kv_groups import kv_groups
from treadle.core.step_data import ModelRunnerOutput, SchedulerOutput
from treadle.distributed import ParallelContext, shard_config, stage_layers
from treadle.executor.base import KVCapacity
from treadle.kv_transfer import create_connector
from treadle.kv_transfer.heads import RankPlacement
from treadle.layers.attention.kv_quant import cache_dtype
from treadle.layers.attention.selector import select_backend
from treadle.loaders import ModelSource, load_model, open_model_source, parse_dtype
from treadle.sampling_params import STRUCTURED_PARAM, StructuredOutputsParams
from treadle.structured.matchers import GrammarMatchers
from treadle.worker.cuda_graph import maybe_graph_runner
from treadle.worker.model_runner import ModelRunner, allocate_kv_cache
from treadle.worker.proposers import build_proposer

IDLE_TRANSFER_WAIT_S = 0.005


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, source: ModelSource | None = None,
                 parallel: ParallelContext | None = None) -> None:
        """``parallel``: this rank's groups (made by the worker process after joining the
        default group); None for a single rank."""
        self.config, self.rank = config, rank
        parallel = parallel or ParallelContext.single(config.model.vocab_size)
        device = torch.device(config.device)
        dtype = parse_dtype(config.load.dtype)
        backend = select_backend(config.attention_backend, device)
        torch.manual_seed(config.load.seed)
        if source is None:
            source = open_model_source(config.load.model_path, config.load.skip_tokenizer_init)
        loaded = load_model(source, backend, dtype, device, config.load.quantization, parallel)
        cache, sched = config.cache, config.scheduler
        local = shard_config(loaded.config, parallel.tp_size, parallel.tp_rank)
        layers = stage_layers(local.num_layers, parallel.pp_size, parallel.pp_rank)
        groups = kv_groups(local, cache.hybrid_kv)
        kv = allocate_kv_cache(local, cache.num_blocks, cache.block_size, cache_dtype(cache.kv_cache_dtype), device,
                               layers, groups)
        graphs = maybe_graph_runner(config.enforce_eager, device, loaded.model, kv, sched.max_num_seqs,
                                    -(-sched.max_model_len // cache.block_size), cache.block_size)
        if graphs is not None:
            graphs.capture()
        grammars = GrammarMatchers(lambda: source.grammars) if source.tokenizer is not None else None
        fused = config.fused_layers and parallel.tp_size == 1
        self.runner = ModelRunner(loaded.model, kv, cache.block_size, sched.max_num_batched_tokens,
                                  device, config.load.seed, graphs, fused, parallel,
                                  config.parallel.comm_overlap, grammars=grammars, kv_groups=groups)
        self.runner.proposer = build_proposer(config.speculative, loaded.model, kv, cache, device, fused)
        self._capacity = KVCapacity(cache.num_blocks, cache.block_size)
        placement = RankPlacement(loaded.config.num_kv_heads, parallel.tp_size, parallel.tp_rank)
        self.kv_connector = None if config.kv_transfer is None else create_connector(config.kv_transfer, kv, placement)

    def kv_capacity(self) -> KVCapacity:
        return self._capacity

    def prepare_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compile ``spec``'s grammar ahead of the step that adds its request (any thread)."""
        if self.runner.grammars is None:
            raise InvalidRequestError("structured output needs a tokenizer, and this engine was started with "
                                      "skip_tokenizer_init", STRUCTURED_PARAM)
        self.runner.grammars.prepare(spec)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        if self.kv_connector is None:
            return self.runner.execute(sched)
        meta = sched.kv_connector_metadata
        self.kv_connector.start_step(meta)
        # layer-wise start: some KV of this step is still arriving; the model waits for each layer
        out = self.runner.execute(sched, self.kv_connector.wait_for_layer_load if meta and meta.streaming else None)
        # an empty step (only transfers pending) waits a little for one to end instead of spinning
        out.kv_connector_output = self.kv_connector.get_finished(IDLE_TRANSFER_WAIT_S if sched.is_empty else 0.0)
        return out

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
