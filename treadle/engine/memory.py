"""Sizing the KV cache: a pure function of the model, the device's memory and the config."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from treadle.config import ModelConfig, TreadleError
from treadle.core.kv_groups import kv_groups
from treadle.layers.attention.kv_quant import row_bytes
from treadle.models.registry import model_layout

GiB = 1 << 30
CPU_DEFAULT_CAP = 1 * GiB  # default KV budget on the CPU when none is given (--kv-cache-memory to change)


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise TreadleError("cannot read available memory; pass kv_cache_memory explicitly")


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """The model's weights held unquantized in ``dtype`` (every tensor its layout lists)."""
    return model_layout(cfg.architecture).weight_bytes(cfg, torch.tensor([], dtype=dtype).element_size())


def bytes_per_block(cfg: ModelConfig, block_size: int, cache_dtype: torch.dtype, hybrid: bool = False) -> int:
    """K and V of ``block_size`` tokens in every layer (``hybrid``: in one KV group's layers,
    ``core/kv_groups.py``), in a cache of ``cache_dtype`` (a quantized cache's per-row scales included)."""
    layers = kv_groups(cfg, hybrid).group_size
    return 2 * layers * block_size * cfg.num_kv_heads * row_bytes(cfg.head_dim, cache_dtype)


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    block_size: int
    bytes_per_block: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def plan_kv_cache(
    cfg: ModelConfig,
    cache_dtype: torch.dtype,
    max_model_len: int,
    max_num_seqs: int,
    available: int,
    weights: int,
    *,
    block_size: int,
    kv_cache_memory: int | None,
    memory_fraction: float,
    num_blocks: int | None,
    on_cpu: bool,
    draft: ModelConfig | None = None,
    draft_token_bytes: int = 0,
    hybrid: bool = False,
) -> KVPlan:
    """How many blocks to allocate: ``num_blocks`` if given; else ``kv_cache_memory`` bytes
    (checked against ``available``); else ``memory_fraction`` of the memory left after the
    weights, capped (on the CPU) and never more than ``max_num_seqs`` full-length sequences use.
    ``draft``: a draft model whose KV shares the blocks (a block holds both models' KV).
    ``cache_dtype``: what the cache holds (a quantized cache's rows carry their scales).
    ``draft_token_bytes``: what a proposer keeps per slot beside its KV (EAGLE: a hidden state).
    ``hybrid``: a block holds one KV group's layers, and a sequence has a table per group."""
    per_block = bytes_per_block(cfg, block_size, cache_dtype, hybrid) + block_size * draft_token_bytes
    if draft is not None:
        per_block += bytes_per_block(draft, block_size, cache_dtype)
    min_blocks = -(-max_model_len // block_size) * len(kv_groups(cfg, hybrid).groups)
    if num_blocks is not None:
        return KVPlan(num_blocks, block_size, per_block)
    if kv_cache_memory is not None:
        budget = kv_cache_memory
        if weights + budget > available:
            raise TreadleError(
                f"the model needs {fmt_bytes(weights)} for weights plus {fmt_bytes(budget)} of KV cache "
                f"= {fmt_bytes(weights + budget)}, but only {fmt_bytes(available)} is available"
            )
    else:
        budget = int((available - weights) * memory_fraction)
        if on_cpu:
            budget = min(budget, CPU_DEFAULT_CAP)
        budget = min(budget, max_num_seqs * min_blocks * per_block)
    blocks = budget // per_block
    if blocks < 1 and kv_cache_memory is not None:
        raise TreadleError(
            f"kv_cache_memory {fmt_bytes(kv_cache_memory)} holds no KV block: one block takes "
            f"{fmt_bytes(per_block)}, one {max_model_len}-token sequence {fmt_bytes(min_blocks * per_block)}"
        )
    if blocks < 1:
        need = weights + min_blocks * per_block
        raise TreadleError(
            f"the model needs {fmt_bytes(weights)} for weights and {fmt_bytes(min_blocks * per_block)} of KV "
            f"cache for one {max_model_len}-token sequence ({fmt_bytes(need)} in all); "
            f"{fmt_bytes(available)} is available"
        )
    return KVPlan(blocks, block_size, per_block)
