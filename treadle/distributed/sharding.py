"""How a model divides across ranks, as pure functions of its config (no process groups).

Tensor parallelism (T ranks)::

    attention heads   H / T per rank (H must divide by T)
    KV heads          K / T per rank; when T > K each KV head is held by T / K ranks
                      (replicated), rank r holding head r * K // T (K and T must divide)
    intermediate      split in units of 32 columns where it can be (GGUF blocks, int4 groups
                      stay whole), so ranks may differ by one unit; so is a MoE's shared expert
                      (its routed experts are split by ``treadle.models.moe``: columns, or whole
                      experts under expert parallelism)
    vocabulary        ceil(V / T) rows per rank; the last rank's tail rows are zero padding,
                      cut off after the logits are gathered

Pipeline parallelism (P stages): stage s runs layers [s * L // P, (s + 1) * L // P).
"""
from __future__ import annotations

import dataclasses

from treadle.config import ModelConfig, TreadleError

UNIT = 32  # columns kept together when a width is split (GGUF / int4 block and group size)


def valid_tp_sizes(cfg: ModelConfig) -> list[int]:
    """Tensor-parallel sizes the head counts allow (attention heads divide by T; KV heads
    divide by T or T by them)."""
    h, k = cfg.num_heads, cfg.num_kv_heads
    return [t for t in range(1, h + 1) if h % t == 0 and (k % t == 0 or t % k == 0)]


def check_parallel_sizes(cfg: ModelConfig, tp: int, pp: int) -> None:
    """One-line TreadleError when the model cannot be split T ways or into P stages."""
    sizes = valid_tp_sizes(cfg)
    if tp not in sizes:
        raise TreadleError(
            f"tensor_parallel_size {tp} does not divide the model's {cfg.num_heads} attention heads and "
            f"{cfg.num_kv_heads} KV heads; valid sizes: {', '.join(map(str, sizes))}")
    if pp > cfg.num_layers:
        raise TreadleError(f"pipeline_parallel_size {pp} is more than the model's {cfg.num_layers} layers")


def partition(total: int, parts: int, index: int, unit: int = 1) -> tuple[int, int]:
    """(start, size) of part ``index`` of ``total`` split ``parts`` ways in whole ``unit``s
    (the last part takes any remainder)."""
    units = total // unit
    start = units * index // parts * unit
    end = total if index == parts - 1 else units * (index + 1) // parts * unit
    return start, end - start


def intermediate_unit(total: int) -> int:
    return UNIT if total % UNIT == 0 else 1


def shard_config(cfg: ModelConfig, tp: int, tp_rank: int) -> ModelConfig:
    """The config of the model one tensor-parallel rank holds (its heads, KV heads,
    intermediate columns and vocabulary rows); the identity for T = 1."""
    if tp == 1:
        return cfg
    inter, moe = cfg.intermediate_size, cfg.moe
    if moe is not None and moe.shared_expert_intermediate_size:  # routed experts: split by the layer itself
        shared = moe.shared_expert_intermediate_size
        moe = dataclasses.replace(moe, shared_expert_intermediate_size=partition(shared, tp, tp_rank,
                                                                                 intermediate_unit(shared))[1])
    return dataclasses.replace(
        cfg,
        moe=moe,
        num_heads=cfg.num_heads // tp,
        num_kv_heads=max(1, cfg.num_kv_heads // tp),
        intermediate_size=partition(inter, tp, tp_rank, intermediate_unit(inter))[1],
        vocab_size=-(-cfg.vocab_size // tp),
    )


def kv_head_range(num_kv_heads: int, tp: int, tp_rank: int) -> range:
    """The model's KV heads that tensor-parallel rank ``tp_rank`` of ``tp`` holds (the rule
    above: K / T of them, or the one head r * K // T when T > K)."""
    start = tp_rank * num_kv_heads // tp
    return range(start, start + max(1, num_kv_heads // tp))


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> range:
    """The decoder layers pipeline stage ``pp_rank`` of ``pp`` runs."""
    start, size = partition(num_layers, pp, pp_rank)
    return range(start, start + size)


def rank_range(full: int, local: int, tp: int, tp_rank: int, unit: int = 1) -> int:
    """First row (or column) of this rank's ``local`` of ``full``: its partition when the
    ranks' parts add up to ``full``, else (replicated KV heads) the block of ``local`` that
    rank ``tp_rank`` of ``tp`` falls into."""
    if local * tp == full:
        return tp_rank * local
    if partition(full, tp, tp_rank, unit)[1] == local:
        return partition(full, tp, tp_rank, unit)[0]
    return (tp_rank * full // tp) // local * local
