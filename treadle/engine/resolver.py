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
    speculation       speculative_config (a dict or its JSON) -> SpeculativeConfig, or None

``create_engine_config`` is the impure shell around it: it opens the checkpoint (once; the
source is handed on to loading) and reads the device's free memory.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import socket
import uuid
from typing import Any

import torch

from treadle.config import (
    KV_CONNECTORS,
    KV_ROLES,
    SPEC_METHODS,
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
from treadle.distributed import check_parallel_sizes, shard_config, stage_layers
from treadle.engine.args import (
    EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    KV_TRANSFER_DEFAULTS,
    SPECULATIVE_DEFAULTS,
    EngineArgs,
    check_numeric_types,
    parse_bytes,
)
from treadle.engine.memory import available_memory, plan_kv_cache, weight_bytes
from treadle.layers.attention.kv_quant import cache_dtype, row_width
from treadle.layers.attention.selector import resolve_backend_name
from treadle.loaders import ModelSource, open_model_source, parse_dtype
from treadle.loaders.hf import weight_files
from treadle.predict.model import shipped_for
from treadle.quantization import resolve_quantization, tensor_parallel_error
from treadle.spec_decode.head_format import HEAD_METHODS, eagle_layer_config, read_head_config

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
    plan = plan_kv_cache(
        rank_cfg, cache_dtype(kv_dtype), scheduler.max_model_len, scheduler.max_num_seqs, available // share, weights // world,
        block_size=args.block_size, kv_cache_memory=None if kv_memory is None else kv_memory // share,
        memory_fraction=args.kv_cache_memory_fraction, num_blocks=args.num_kv_blocks, on_cpu=on_cpu, draft=draft,
        draft_token_bytes=draft_head_token_bytes(speculative, source, dtype),
    )
    return EngineConfig(
        model=source.config,
        load=LoadConfig(model_path=str(source.path), dtype=str(dtype).removeprefix("torch."),
                        quantization=quantization, seed=args.seed,
                        skip_tokenizer_init=args.skip_tokenizer_init),
        cache=CacheConfig(block_size=plan.block_size, num_blocks=plan.num_blocks,
                          bytes_per_block=plan.bytes_per_block, enable_prefix_caching=args.enable_prefix_caching,
                          kv_cache_dtype=kv_dtype),
        scheduler=scheduler,
        parallel=parallel,
        device=str(device),
        attention_backend=resolve_backend_name(args.attention_backend, device),
        # a MoE step reads its expert group sizes on the host (no CUDA graph can hold that)
        enforce_eager=args.enforce_eager or device.type != "cuda" or world > 1 or source.config.moe is not None,
        fused_layers=args.fused_layers,
        speculative=speculative,
        kv_transfer=_kv_transfer_without_pipeline(args),
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


def free_ports(ip: str, count: int) -> int:
    """The first of ``count`` consecutive free ports (tensor-parallel rank r serves KV on
    ``kv_port + r``)."""
    for _ in range(50):
        with contextlib.ExitStack() as stack:
            first = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            first.bind((ip, 0))
            port = int(first.getsockname()[1])
            try:
                for r in range(1, count):
                    stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)).bind((ip, port + r))
            except OSError:
                continue
            return port
    raise TreadleError(f"kv_transfer_config: found no {count} consecutive free ports on {ip}; set kv_port")


def _kv_transfer_without_pipeline(args: EngineArgs) -> KVTransferConfig | None:
    kv = resolve_kv_transfer(args.kv_transfer_config)
    if kv is not None and args.pipeline_parallel_size > 1:
        raise TreadleError(f"kv_transfer_config is not available with pipeline parallelism (pipeline_parallel_size "
                           f"{args.pipeline_parallel_size}); tensor parallelism is (tensor_parallel_size)")
    return kv


def _json_option(raw: dict[str, Any] | str | None, name: str, known: dict[str, Any],
                 example: str) -> dict[str, Any] | None:
    """A JSON-object option (a dict, or its JSON text from the CLI): None when unset or empty;
    not JSON, not an object, or an unknown key -> a one-line TreadleError naming ``name``."""
    if raw is None or raw == "" or raw == {}:
        return None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise TreadleError(f"{name} is not valid JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(raw, dict):
        raise TreadleError(f"{name} must be a JSON object, e.g. {example}")
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise TreadleError(f"unknown {name} key {unknown[0]!r}; known: {', '.join(known)}")
    return raw


def resolve_kv_transfer(raw: dict[str, Any] | str | None) -> KVTransferConfig | None:
    """``kv_transfer_config`` (a dict or its JSON) -> KVTransferConfig (port 0 and engine id ""
    are settled by ``create_engine_config``); None or empty -> None. Bad keys or values are
    one-line TreadleErrors."""
    parsed = _json_option(raw, "kv_transfer_config", KV_TRANSFER_DEFAULTS, '{"kv_connector": "tcp", ...}')
    if parsed is None:
        return None
    kv = {**KV_TRANSFER_DEFAULTS, **parsed}
    if kv["kv_connector"] not in KV_CONNECTORS:
        raise TreadleError(f"kv_transfer_config kv_connector {kv['kv_connector']!r} is not one of "
                           f"{', '.join(KV_CONNECTORS)}")
    if kv["kv_role"] not in KV_ROLES:
        raise TreadleError(f"kv_transfer_config kv_role {kv['kv_role']!r} is not one of {', '.join(KV_ROLES)}")
    port = kv["kv_port"]
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port < 65536:
        raise TreadleError("kv_transfer_config kv_port must be an integer in [0, 65535]")
    for key in ("transfer_timeout_s", "producer_block_timeout_s"):
        if not isinstance(kv[key], (int, float)) or isinstance(kv[key], bool) or not kv[key] > 0:
            raise TreadleError(f"kv_transfer_config {key} must be a positive number of seconds")
    if not isinstance(kv["layerwise_start"], bool):
        raise TreadleError("kv_transfer_config layerwise_start must be true or false")
    return KVTransferConfig(connector=kv["kv_connector"], role=kv["kv_role"], ip=str(kv["kv_ip"]), port=port,
                            engine_id=str(kv["engine_id"] or ""),
                            transfer_timeout_s=float(kv["transfer_timeout_s"]),
                            producer_block_timeout_s=float(kv["producer_block_timeout_s"]),
                            layerwise_start=kv["layerwise_start"])


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
    """``kv_cache_dtype`` resolved: auto -> the model's dtype name; int8 / fp8 kept (checked)."""
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


def resolve_speculative(raw: dict[str, Any] | str | None) -> SpeculativeConfig | None:
    """``speculative_config`` (a dict, or its JSON text from the CLI) -> SpeculativeConfig;
    None or an empty value -> None. Unknown keys and bad values are one-line TreadleErrors."""
    parsed = _json_option(raw, "speculative_config", SPECULATIVE_DEFAULTS, '{"method": "ngram"}')
    if parsed is None:
        return None
    spec = {**SPECULATIVE_DEFAULTS, **parsed}
    method = spec["method"] or ("draft_model" if spec["model"] else None)
    if method not in SPEC_METHODS:
        raise TreadleError(f"speculative_config method {method!r} is not one of {', '.join(SPEC_METHODS)}")
    ints = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
    for key in ints:
        if not isinstance(spec[key], int) or isinstance(spec[key], bool) or spec[key] < 1:
            raise TreadleError(f"speculative_config {key} must be an integer of at least 1")
    if spec["prompt_lookup_min"] > spec["prompt_lookup_max"]:
        raise TreadleError("speculative_config prompt_lookup_min must not exceed prompt_lookup_max")
    if not isinstance(spec["fallback"], bool):
        raise TreadleError("speculative_config fallback must be true or false")
    model, draft_layers = _draft_model_name(method, spec["model"])
    return SpeculativeConfig(method=method, model=model, draft_layers=draft_layers, fallback=spec["fallback"],
                             **{k: spec[k] for k in ints})


def _draft_model_name(method: str, model: object) -> tuple[str | None, int | None]:
    """(path or name, None) or, for ``"self:N"``, (None, N): the target's first N layers; an
    eagle / medusa head's directory (None: the target's own, see ``with_draft_head``)."""
    if method in HEAD_METHODS:
        if model is not None and (not isinstance(model, str) or not model):
            raise TreadleError(f'speculative method {method} needs "model": a draft-head directory')
        return model, None
    if method != "draft_model":
        return None, None
    if not isinstance(model, str) or not model:
        raise TreadleError('speculative method draft_model needs "model": a path, a name, or "self:N" '
                           "(the target's first N layers)")
    if not model.startswith("self:"):
        return model, None
    n = model.removeprefix("self:")
    if not n.isdigit() or int(n) < 1:
        raise TreadleError(f'speculative_config model {model!r}: "self:N" needs a layer count N of at least 1')
    return None, int(n)


def draft_model_config(spec: SpeculativeConfig | None, target: ModelSource) -> ModelConfig | None:
    """The config of a draft model with its own KV cache (None: no draft, or a layer-skip one
    sharing the target's KV); checks the draft's vocabulary against the target's."""
    if spec is None or spec.method != "draft_model":
        return None
    if spec.draft_layers is not None:
        if spec.draft_layers >= target.config.num_layers:
            raise TreadleError(f"speculative_config model 'self:{spec.draft_layers}': the draft must use fewer "
                               f"layers than the target's {target.config.num_layers}")
        return None
    assert spec.model is not None
    draft = open_model_source(spec.model)
    if draft.config.vocab_size != target.config.vocab_size:
        raise TreadleError(f"draft model {spec.model}: vocabulary of {draft.config.vocab_size} tokens, the "
                           f"target's has {target.config.vocab_size}; a draft needs the target's vocabulary")
    probe = "Once upon a time, 42 cats said: hello!"
    if draft.tokenizer is not None and target.tokenizer is not None and \
            draft.tokenizer.encode(probe) != target.tokenizer.encode(probe):
        raise TreadleError(f"draft model {spec.model}: its tokenizer differs from the target's; "
                           "a draft needs the target's vocabulary")
    return draft.config


def with_draft_head(spec: SpeculativeConfig | None, target: ModelSource) -> SpeculativeConfig | None:
    """eagle / medusa: the head's directory (default: the target directory's
    ``draft-heads/<method>``, e.g. the heads shipped with stories260k), checked against the
    target (a one-line TreadleError for a missing, malformed or mismatched head)."""
    if spec is None or spec.method not in HEAD_METHODS:
        return spec
    model = spec.model
    if model is None:
        default = target.path / "draft-heads" / spec.method
        if not (target.path.is_dir() and default.is_dir()):
            raise TreadleError(f'speculative method {spec.method} needs "model": a draft-head directory (make one '
                               f"with `treadle train-draft-head`); {target.path} ships no {spec.method} head")
        model = str(default)
    head = read_head_config(model)
    if head.method != spec.method:
        raise TreadleError(f"draft head {model} is a {head.method} head, not {spec.method}")
    why = head.target.mismatch(target.config)
    if why is not None:
        raise TreadleError(f"draft head {model} does not fit this model: {why}")
    if head.method == "medusa" and spec.num_speculative_tokens > head.num_speculative_tokens:
        raise TreadleError(f"draft head {model} has {head.num_speculative_tokens} Medusa heads; "
                           f"num_speculative_tokens {spec.num_speculative_tokens} needs as many")
    return dataclasses.replace(spec, model=model)


def draft_head_token_bytes(spec: SpeculativeConfig | None, target: ModelSource, dtype: torch.dtype) -> int:
    """Bytes per KV slot the EAGLE proposer keeps beside its KV: the target's hidden state (its
    lazy catch-up, ``spec_decode/head_proposers.py``); 0 for every other method."""
    if spec is None or spec.method != "eagle":
        return 0
    return target.config.hidden_size * dtype.itemsize


def draft_head_kv_config(spec: SpeculativeConfig | None, target: ModelSource) -> ModelConfig | None:
    """The EAGLE layer's config (its KV shares the blocks); None for every other method."""
    if spec is None or spec.method != "eagle" or spec.model is None:
        return None
    head = read_head_config(spec.model)
    assert head.layer is not None
    return eagle_layer_config(target.config, head.layer)
