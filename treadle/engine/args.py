"""EngineArgs: every user-facing engine setting and its default, in one place (vLLM's names).

The CLI flags (``treadle.engine.cli_args``), ``LLM(...)``, ``LLMEngine.from_args`` and
``AsyncLLM.from_args`` all read their defaults from here; ``auto`` values and everything derived
from the checkpoint or the machine are settled by ``treadle.engine.resolver.resolve_config``.

Each field's ``metadata`` carries its CLI help (and ``choices`` / ``type`` where argparse needs
them); ``cli=False`` keeps a field off the command line.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from treadle.config import SchedulerConfig, TreadleError
from treadle.core.cost_policy import SCHEDULING_POLICIES

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
EXECUTOR_BACKENDS = ("uni", "mp", "ray")
KV_CACHE_DTYPES = ("auto", "bfloat16", "int8", "fp8")


def _arg(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


@dataclass(frozen=True)
class EngineArgs:
    model: str = _arg("smollm2-135m-instruct", "short name (stories260k, smollm2-135m-instruct) or path")
    dtype: str = _arg("auto", "weights and activations (auto: float32)", choices=DTYPE_CHOICES)
    device: str = _arg("cpu", "torch device: cpu, cuda, cuda:1 ...")
    seed: int = _arg(0, "seed of the engine's random state")
    max_model_len: int | None = _arg(None, "longest sequence, prompt + output (default: the model's limit)",
                                     type=int)
    max_num_seqs: int = _arg(64, "most sequences in one step")
    max_num_batched_tokens: int = _arg(512, "most tokens in one step (raised to max_model_len without chunking)")
    enable_chunked_prefill: bool = _arg(True, "split long prompts into chunks that share steps with decodes")
    enable_prefix_caching: bool = _arg(True, "reuse KV blocks of prompts that share a prefix")
    kv_cache_memory: int | str | None = _arg(
        None, "KV cache size, e.g. 2GiB (default: a share of free memory, at most 1 GiB on the CPU)", type=str)
    kv_cache_memory_fraction: float = _arg(0.5, "without --kv-cache-memory: share of the memory left after "
                                                "the weights given to the KV cache")
    block_size: int = _arg(16, "tokens per KV block")
    num_kv_blocks: int | None = _arg(None, "exact number of KV blocks (overrides the memory budget)", type=int)
    disable_hybrid_kv_cache_manager: bool = _arg(
        False, "one block table for all layers, also on models mixing sliding-window and full-attention layers "
               "(Gemma 3), whose sliding layers then keep every token's KV instead of their window's")
    kv_cache_dtype: str = _arg("auto", "what the KV cache stores: auto (the model's dtype), bfloat16 (a float32 "
                                       "model's cache at half the bytes, like llama.cpp's f16 cache), int8 (symmetric, "
                                       "a float32 scale per token and KV head) or fp8 (e4m3, scaled the same way); "
                                       "int8/fp8 hold ~2x the tokens of bf16, ~4x of float32",
                               choices=KV_CACHE_DTYPES)
    attention_backend: str = _arg("auto", "auto: cpu on the CPU, triton on CUDA",
                                  choices=("auto", "reference", "cpu", "triton"))
    quantization: str = _arg("auto", "auto (a GGUF file keeps its quantized blocks, Q4_0..Q8_0 and K-quants, on the CPU; "
                                     "a checkpoint with a quantization_config is read as stored), none, "
                                     "gguf, int8, int4[-g32|-g64|-g128], compressed-tensors, gptq, awq")
    enforce_eager: bool = _arg(False, "no CUDA graphs (decode runs eagerly)")
    fused_layers: bool = _arg(True, "CPU: run each decoder layer it can as one fused C call")
    distributed_executor_backend: str = _arg("uni", "uni: the model runs in this process; mp: in worker "
                                                    "processes on this machine; ray: Ray actors across a "
                                                    "cluster", choices=EXECUTOR_BACKENDS)
    tensor_parallel_size: int = _arg(1, "ranks a layer is split across", flags=("-tp", "--tensor-parallel-size"))
    pipeline_parallel_size: int = _arg(1, "stages the layers are split into",
                                       flags=("-pp", "--pipeline-parallel-size"))
    comm_overlap: bool = _arg(False, "tensor parallelism: cut each step into two micro-batches whose "
                                     "all-reduces run while the other computes")
    enable_expert_parallel: bool = _arg(False, "mixture-of-experts models under tensor parallelism: each rank "
                                               "holds E / T whole experts (default: every expert, 1 / T of each)")
    speculative_config: dict[str, Any] | str | None = _arg(
        None, 'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
              '(keys: method, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, fallback, model; '
              'draft_model: "model" is a path, a name or "self:N", the target\'s first N layers)',
        type=str)
    kv_transfer_config: dict[str, Any] | str | None = _arg(
        None, 'prefill/decode disaggregation as JSON, e.g. \'{"kv_connector": "tcp", "kv_role": "kv_producer"}\' '
              '(keys: kv_connector tcp|shm, kv_role kv_producer|kv_consumer|kv_both, kv_ip, kv_port, '
              'transfer_timeout_s, producer_block_timeout_s, layerwise_start)', type=str)
    scheduling_policy: str = _arg(SchedulerConfig.scheduling_policy,
                                  "waiting order and preemption victims: fcfs (arrival), priority (explicit "
                                  "priority, then arrival), predicted (priority, then predicted remaining cost "
                                  "with aging; see docs/scheduling.md)", choices=SCHEDULING_POLICIES)
    scheduling_aging_s: float = _arg(SchedulerConfig.scheduling_aging_s,
                                     "predicted: no request is passed over by one that arrived this many "
                                     "seconds after it")
    scheduling_max_passed_over: int = _arg(SchedulerConfig.scheduling_max_passed_over,
                                           "predicted: no request is passed over by more than this many "
                                           "later arrivals of its priority (then it goes first)")
    length_predictor: str = _arg(
        "auto", "predicted: the output-length predictor, a directory written by treadle train-length-predictor "
                "(auto: the one shipped for the model, if any; none: no prediction)", type=str)
    skip_tokenizer_init: bool = _arg(False, "load no tokenizer: prompts are token ids and outputs carry token "
                                            "ids only (no text, stop strings, chat or structured output)")


# annotation -> (types, None allowed, what to say)
_NUMERIC: dict[str, tuple[type | tuple[type, ...], bool, str]] = {
    "int": (int, False, "an integer"), "int | None": (int, True, "an integer"), "float": ((int, float), False, "a number"),
}


def check_numeric_types(args: EngineArgs) -> None:
    """Every field annotated int / int | None / float holds one (a bool does not count)."""
    for f in dataclasses.fields(EngineArgs):
        if str(f.type) not in _NUMERIC:
            continue
        types, optional, what = _NUMERIC[str(f.type)]
        value = getattr(args, f.name)
        if not (value is None and optional) and (not isinstance(value, types) or isinstance(value, bool)):
            raise TreadleError(f"{f.name} must be {what}, not {value!r}")


def engine_args(model: str | None = None, **kwargs: Any) -> EngineArgs:
    """EngineArgs from keyword arguments; an unknown name is one clear TreadleError."""
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise TreadleError(f"unknown engine argument {unknown[0]!r}; known: {', '.join(sorted(names))}")
    if model is not None:
        kwargs["model"] = model
    return EngineArgs(**kwargs)


_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1000, "KIB": 1 << 10, "M": 1 << 20, "MB": 10**6, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 10**9, "GIB": 1 << 30, "T": 1 << 40, "TB": 10**12, "TIB": 1 << 40}


def parse_bytes(value: int | str | None) -> int | None:
    """'2GiB', '512MB', '1e9' or an int -> bytes."""
    if value is None or isinstance(value, int):
        return value
    s = value.strip().upper().replace(" ", "")
    num = s.rstrip("KMGTIB")
    unit = s[len(num):]
    try:
        if unit in _UNITS and num:
            return int(float(num) * _UNITS[unit])
    except ValueError:
        pass
    raise TreadleError(f"cannot read memory size {value!r}; write e.g. 2GiB or 512MiB")
