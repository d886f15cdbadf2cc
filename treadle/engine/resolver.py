"""Start-up resolution: (EngineArgs, ModelSource, available memory) -> EngineConfig.

``resolve_config`` is pure: it loads no weights and measures nothing (the free memory is
passed in), so every default and every ``auto`` can be unit-tested from a checkpoint's config.
It owns:

    dtype             auto -> float32 (``loaders.parse_dtype``: the CPU kernels compute in it)
    quantization      auto -> the checkpoint's quantization_config method (compressed-tensors,
                      gptq, awq), else gguf for a .gguf file on the CPU, else none
    max_model_len     None -> the model's max_position_embeddings; larger values are clamped
    batched tokens    without chunked prefill, at least max_model_len (a prompt runs whole)
    KV cache dtype    auto -> the model's dtype; int8 / fp8 (layers.attention.kv_quant) size the
                      blocks with their scales
    KV cache          blocks from num_kv_blocks, kv_cache_memory or a share of free memory,
                      planned for one rank's part (its KV heads, its stage's layers); on the CPU
                      the ranks share the machine, so memory and kv_cache_memory are divided
    parallelism       head counts checked for the tensor-parallel size; uni -> mp with several
                      ranks; no CUDA graphs with several ranks
    attention backend auto -> cpu on the CPU, triton (or reference) on CUDA
    CUDA graphs       off unless the device is CUDA and enforce_eager is False (and never for MoE)
    speculation       speculative_config -> SpeculativeConfig (parsed and checked against the
                      target by ``spec_decode/options.py``), or None
    KV transfer       kv_transfer_config -> KVTransferConfig (``kv_transfer/options.py``), its port

``create_engine_config`` is the impure shell around it: it opens the checkpoint (once; the
source is handed on to loading) and reads the device's free memory.
"""
from __future__ import annotations

import dataclasses
import logging
import uuid

import torch

from treadle.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    TreadleError,
)
from treadle.core.kv_groups import kv_groups
from treadle.distributed import check_parallel_sizes, shard_config, stage_layers
from treadle.engine.args import (
    EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    EngineArgs,
    check_numeric_types,
    parse_bytes,
)
from treadle.engine.memory import available_memory, plan_kv_cache, weight_bytes
from treadle.kv_transfer.options import free_ports, resolve_kv_transfer
from treadle.layers.attention.kv_quant import cache_dtype, row_width
from treadle.layers.attention.selector import resolve_backend_name
from treadle.loaders import ModelSource, open_model_source, parse_dtype
from treadle.loaders.hf import weight_files
from treadle.predict.model import shipped_for
from treadle.quantization import resolve_quantization, tensor_parallel_error
from treadle.spec_decode.options import (
    draft_head_kv_config,
    draft_head_token_bytes,
    draft_model_config,
    resolve_speculative,
    with_draft_head,
)

logger = logging.getLogger("treadle")


def _resident_weight_bytes(source: ModelSource, quantization: str, dtype: torch.dtype) -> int:
    """What the loaded weights will take: native GGUF and published quantized checkpoints keep
    (about) their files' packed size; everything else is the layout's tensors in ``dtype``."""
    if quantization == "gguf":
        return source.path.stat().st_size
    if source.checkpoint_quantization is not None:
        return sum(f.stat().st_size for f in weight_files(source.path))
    return weight_bytes(source.config, dtype)


def resolve_config(args: EngineArgs, source: ModelSource, available: int) -> EngineConfig:
    """The concrete engine configuration for ``args`` on ``source`` with ``available`` bytes free."""
    _check_ranges(args)
    device = _parse_device(args.device)
    dtype = parse_dtype(args.dtype)
    on_cpu = device.type == "cpu"
    is_gguf = source.raw_weights is not None and source.tensor_types is not None
    checkpoint = source.checkpoint_quantization
    quantization = resolve_quantization(args.quantization, is_gguf, on_cpu, checkpoint.method if checkpoint else None)
    scheduler = _scheduler_config(args, source.config.max_position_embeddings)
    parallel = _parallel_config(args, source.config)
    if checkpoint is not None and parallel.tensor_parallel_size > 1 and not checkpoint.tensor_parallel:
        raise tensor_parallel_error(checkpoint.method)
    world = parallel.world_size
    rank_cfg = _rank_config(source.config, parallel)
    weights = _resident_weight_bytes(source, quantization, dtype)
    kv_memory = parse_bytes(args.kv_cache_memory)
    speculative = with_draft_head(_speculative_on_one_rank(args), source)
    draft = draft_model_config(speculative, source)
    if draft is not None:
        weights += weight_bytes(draft, dtype)
    else:
        draft = draft_head_kv_config(speculative, source)
    kv_dtype = _kv_cache_dtype(args.kv_cache_dtype, dtype, source.config.head_dim)
    share = world if on_cpu else 1
    # KV groups per attention kind (sliding layers keep their window) unless a KV connector moves blocks
    kv_transfer = _kv_transfer_without_pipeline(args)
    hybrid = not args.disable_hybrid_kv_cache_manager and kv_transfer is None and kv_groups(rank_cfg, True).hybrid
    plan = plan_kv_cache(
        rank_cfg, cache_dtype(kv_dtype), scheduler.max_model_len, scheduler.max_num_seqs, available // share, weights // world,
        block_size=args.block_size, kv_cache_memory=None if kv_memory is None else kv_memory // share,
        memory_fraction=args.kv_cache_memory_fraction, num_blocks=args.num_kv_blocks, on_cpu=on_cpu, draft=draft,
        draft_token_bytes=draft_head_token_bytes(speculative, source, dtype), hybrid=hybrid,
    )
    return EngineConfig(
        model=source.config,
        load=LoadConfig(model_path=str(source.path), dtype=str(dtype).removeprefix("torch."),
                        quantization=quantization, seed=args.seed,
                        skip_tokenizer_init=args.skip_tokenizer_init),
        cache=CacheConfig(block_size=plan.block_size, num_blocks=plan.num_blocks,
                          bytes_per_block=plan.bytes_per_block, enable_prefix_caching=args.enable_prefix_caching,
                          kv_cache_dtype=kv_dtype, hybrid_kv=hybrid),
        scheduler=scheduler,
        parallel=parallel,
        device=str(device),
        attention_backend=resolve_backend_name(args.attention_backend, device),
        # a MoE step reads its expert group sizes on the host (no CUDA graph can hold that)
        enforce_eager=args.enforce_eager or device.type != "cuda" or world > 1 or source.config.moe is not None,
        fused_layers=args.fused_layers,
        speculative=speculative,
        kv_transfer=kv_transfer,
    )


def create_engine_config(args: EngineArgs) -> tuple[EngineConfig, ModelSource]:
    """Open the checkpoint, read the free memory, resolve. The source goes on to loading."""
    device = _parse_device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TreadleError(f"device {args.device!r}: CUDA is not available on this machine")
    source = open_model_source(args.model, args.skip_tokenizer_init)
    config = resolve_config(args, source, available_memory(device))
    if config.kv_transfer is not None and (config.kv_transfer.port == 0 or not config.kv_transfer.engine_id):
        kv = config.kv_transfer
        port = kv.port or free_ports(kv.ip, config.parallel.tensor_parallel_size)
        config = dataclasses.replace(config, kv_transfer=dataclasses.replace(
            kv, port=port, engine_id=kv.engine_id or uuid.uuid4().hex[:12]))
    return config, source


def _kv_transfer_without_pipeline(args: EngineArgs) -> KVTransferConfig | None:
    kv = resolve_kv_transfer(args.kv_transfer_config)
    if kv is not None and args.pipeline_parallel_size > 1:
        raise TreadleError(f"kv_transfer_config is not available with pipeline parallelism (pipeline_parallel_size "
                           f"{args.pipeline_parallel_size}); tensor parallelism is (tensor_parallel_size)")
    return kv


def _check_ranges(args: EngineArgs) -> None:
    check_numeric_types(args)  # first, so that the comparisons below cannot fail
    checks = [
        (0 <= args.seed < 2**63, "seed must be in [0, 2**63)"),
        (args.max_num_seqs >= 1, "max_num_seqs must be at least 1"),
        (args.max_num_batched_tokens >= 1, "max_num_batched_tokens must be at least 1"),
        (args.block_size >= 1, "block_size must be at least 1"),
        (args.max_model_len is None or args.max_model_len >= 1, "max_model_len must be at least 1"),
        (args.num_kv_blocks is None or args.num_kv_blocks >= 1, "num_kv_blocks must be at least 1"),
        (0.0 < args.kv_cache_memory_fraction <= 1.0, "kv_cache_memory_fraction must be in (0, 1]"),
        (args.tensor_parallel_size >= 1, "tensor_parallel_size must be at least 1"),
        (args.pipeline_parallel_size >= 1, "pipeline_parallel_size must be at least 1"),
    ]
    for ok, message in checks:
        if not ok:
            raise TreadleError(message)


def _kv_cache_dtype(name: str, dtype: torch.dtype, head_dim: int) -> str:
    """``kv_cache_dtype`` resolved: auto -> the model's dtype name; bfloat16 / int8 / fp8 kept (checked)."""
    if name not in KV_CACHE_DTYPES:
        raise TreadleError(f"kv_cache_dtype {name!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    if name == "auto":
        return str(dtype).removeprefix("torch.")
    row_width(head_dim, cache_dtype(name))  # a one-line error for a head_dim the layout cannot hold
    return name


def _parse_device(name: str) -> torch.device:
    try:
        return torch.device(name)
    except (RuntimeError, ValueError):
        raise TreadleError(f"device {name!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None


def _scheduler_config(args: EngineArgs, model_limit: int) -> SchedulerConfig:
    max_model_len = model_limit if args.max_model_len is None else args.max_model_len
    if max_model_len > model_limit:
        logger.warning("max_model_len %d is longer than the model's %d positions; using %d",
                       max_model_len, model_limit, model_limit)
        max_model_len = model_limit
    batched = args.max_num_batched_tokens
    if not args.enable_chunked_prefill:
        batched = max(batched, max_model_len)  # a whole prompt must fit one step
    return SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=batched,
                           max_model_len=max_model_len, enable_chunked_prefill=args.enable_chunked_prefill,
                           scheduling_policy=args.scheduling_policy, scheduling_aging_s=float(args.scheduling_aging_s),
                           scheduling_max_passed_over=int(args.scheduling_max_passed_over),
                           length_predictor=_length_predictor(args))


def _length_predictor(args: EngineArgs) -> str | None:
    """``length_predictor``: none -> None; auto -> the one shipped for the model, if any; else the
    directory given (checked when the engine loads it)."""
    if args.length_predictor == "none":
        return None
    if args.length_predictor == "auto":
        path = shipped_for(args.model)
        return None if path is None else str(path)
    return args.length_predictor


def _parallel_config(args: EngineArgs, model: ModelConfig) -> ParallelConfig:
    backend = args.distributed_executor_backend
    if backend not in EXECUTOR_BACKENDS:
        raise TreadleError(f"distributed_executor_backend {backend!r} is not one of {', '.join(EXECUTOR_BACKENDS)}")
    check_parallel_sizes(model, args.tensor_parallel_size, args.pipeline_parallel_size)
    if backend == "uni" and args.tensor_parallel_size * args.pipeline_parallel_size > 1:
        backend = "mp"  # several ranks need worker processes
    return ParallelConfig(distributed_executor_backend=backend, tensor_parallel_size=args.tensor_parallel_size,
                          pipeline_parallel_size=args.pipeline_parallel_size, comm_overlap=args.comm_overlap,
                          enable_expert_parallel=args.enable_expert_parallel)


def _rank_config(cfg: ModelConfig, parallel: ParallelConfig) -> ModelConfig:
    """The part of the model one rank holds, for memory planning: its tensor-parallel shard
    and the largest pipeline stage's layer count."""
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    layers = max(len(stage_layers(cfg.num_layers, pp, s)) for s in range(pp))
    return dataclasses.replace(shard_config(cfg, tp, 0), num_layers=layers)



def _speculative_on_one_rank(args: EngineArgs) -> SpeculativeConfig | None:
    spec = resolve_speculative(args.speculative_config)
    if spec is not None and args.tensor_parallel_size * args.pipeline_parallel_size > 1:
        raise TreadleError("speculative decoding is not available with tensor or pipeline parallelism yet")
    return spec


