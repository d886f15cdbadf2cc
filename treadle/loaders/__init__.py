"""Weight loaders: a checkpoint becomes a ModelSource (config, streamed
Hugging Face-named tensors, tokenizer); ``load_model`` builds the model from it."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from treadle.config import ModelConfig, TreadleError
from treadle.distributed import ParallelContext, shard_config
from treadle.layers.attention import AttentionBackend
from treadle.loaders import huge_pages
from treadle.loaders.source import ModelSource
from treadle.models.llama import LlamaForCausalLM
from treadle.models.registry import model_class, model_layout

if TYPE_CHECKING:
    from treadle.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None
    path: Path


def open_model_source(name_or_path: str, skip_tokenizer_init: bool = False) -> ModelSource:
    """Resolve a short name or a path and open it (HF directory or GGUF file); with
    ``skip_tokenizer_init`` no tokenizer is read (``source.tokenizer`` is None)."""
    from treadle.loaders.resolve import resolve_model

    path = resolve_model(name_or_path)
    if path.is_dir():
        from treadle.loaders.hf import open_hf_dir

        return open_hf_dir(path, skip_tokenizer_init)
    if path.suffix == ".gguf":
        from treadle.loaders.gguf import open_gguf

        return open_gguf(path, skip_tokenizer_init)
    raise TreadleError(f"{path}: not a Hugging Face model directory or a .gguf file")


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise TreadleError(f"dtype {dtype!r} is not supported; use one of {', '.join(_DTYPES)}") from None


def quantization_plan(
    source: ModelSource, quantization: str | None, device: str | torch.device = "cpu",
    local_config: ModelConfig | None = None,
) -> tuple[Callable[[str], Any] | None, Callable[[], Iterator[tuple[str, Any]]]]:
    """(linear-method factory, weight stream) for a quantization name: None/"none" (float),
    "auto" ("gguf" for a GGUF file on the CPU, else none), "gguf" (keep Q4_0..Q8_0 and K-quant
    blocks quantized; CPU kernels), or a weight-only name such as "int8" or "int4-g64"
    (see treadle.quantization). ``local_config``: the config of the part this rank holds under
    tensor parallelism (its layers' input widths decide the weight-only methods)."""
    from treadle.quantization import resolve_quantization, tensor_parallel_error, weight_only_factory
    from treadle.quantization.formats.checkpoint import checkpoint_method_factory
    from treadle.quantization.methods.gguf_native import GGUFNativePlan

    layout = model_layout(source.config.architecture)
    on_cpu = torch.device(device).type == "cpu"
    is_gguf = source.raw_weights is not None and source.tensor_types is not None
    checkpoint = source.checkpoint_quantization
    try:
        quantization = resolve_quantization(quantization, is_gguf, on_cpu, checkpoint.method if checkpoint else None)
    except TreadleError as e:
        raise TreadleError(f"{source.path}: {e}") from None
    if quantization == "none":
        return None, source.weights
    if checkpoint is not None:
        if local_config is not None and local_config != source.config and not checkpoint.tensor_parallel:
            raise TreadleError(f"{source.path}: {tensor_parallel_error(checkpoint.method)}")
        return checkpoint_method_factory(checkpoint, layout.shard_names), source.weights
    if quantization == "gguf":
        assert source.raw_weights is not None and source.tensor_types is not None
        shard_names = partial(layout.shard_names, cfg=source.config)  # with cfg: a MoE's stacked experts too
        plan, raw_weights = GGUFNativePlan(source.tensor_types, shard_names), source.raw_weights
        return plan.method, lambda: raw_weights(plan.keeps_raw)
    full = partial(layout.in_features, source.config)
    return weight_only_factory(quantization, partial(layout.in_features, local_config or source.config),
                               full if local_config is not None else None), source.weights


def load_model(
    name_or_path: str | ModelSource,
    backend: AttentionBackend,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    quantization: str | None = None,
    parallel: ParallelContext | None = None,
) -> LoadedModel:
    """``quantization``: see ``quantization_plan`` (None keeps every weight in float). An
    already opened ``ModelSource`` is used as it is (the engine opens the checkpoint once).
    ``parallel``: this worker's place among tensor/pipeline ranks (default: the only one); the
    model then holds, and reads from the checkpoint, only its rank's part."""
    from treadle.quantization.methods.bfloat16_cpu import activation_dtype, bfloat16_cpu_factory
    from treadle.quantization.methods.float32_cpu import float32_cpu_factory

    source = name_or_path if isinstance(name_or_path, ModelSource) else open_model_source(name_or_path)
    cls = model_class(source.config.architecture)
    torch_dtype = parse_dtype(dtype)
    local = None if parallel is None else shard_config(source.config, parallel.tp_size, parallel.tp_rank)
    method, weights = quantization_plan(source, quantization, device, local)
    method = float32_cpu_factory(bfloat16_cpu_factory(method, torch_dtype, device), torch_dtype, device)
    if parallel is not None and parallel.world_size > 1 and weights is source.weights and source.sliced_weights:
        weights = source.sliced_weights  # each rank reads only its part of each tensor
    with torch.device(device):  # bfloat16 on the CPU: bfloat16 weights, float32 activations
        model = cls(source.config, backend, activation_dtype(torch_dtype, device), method=method, parallel=parallel)
    model.load_weights(weights())
    model.process_weights_after_loading()
    if torch.device(device).type == "cpu":
        huge_pages.gather(model)
    model.eval()
    return LoadedModel(model=model, config=source.config, tokenizer=source.tokenizer, path=source.path)
