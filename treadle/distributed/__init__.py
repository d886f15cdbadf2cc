"""Scale-out over torch.distributed: the per-rank parallel context (process groups and the
collectives a model step uses), how a model's tensors divide across tensor-parallel ranks,
and the stage-to-stage transfers of pipeline parallelism.

    global rank = pp_rank * T + tp_rank          (T = tensor_parallel_size, P = pipeline stages)

    stage 0: ranks 0 .. T-1        --(hidden, residual) send/recv, rank i -> rank i + T-->
    stage 1: ranks T .. 2T-1       ...
    stage P-1: ranks (P-1)T .. PT-1   the last one (PT-1) gathers the logits and samples; the
                                      sampled tokens are broadcast to every rank
"""
from treadle.distributed.parallel import ParallelContext, StageCarry
from treadle.distributed.sharding import check_parallel_sizes, shard_config, stage_layers

__all__ = ["ParallelContext", "StageCarry", "check_parallel_sizes", "shard_config", "stage_layers"]
