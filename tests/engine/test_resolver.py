"""The start-up resolver: EngineArgs + an opened checkpoint + free memory -> EngineConfig.

Pure: the sources here refuse to stream weights, so a resolver that touched them would fail.
"""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from treadle.config import TreadleError
from treadle.engine.args import EngineArgs, engine_args
from treadle.engine.cli_args import add_engine_args, engine_kwargs
from treadle.engine.memory import CPU_DEFAULT_CAP, GiB, bytes_per_block, weight_bytes
from treadle.engine.resolver import resolve_config
from treadle.loaders import ModelSource, open_model_source, parse_dtype
from treadle.spec_decode.options import draft_head_kv_config

PLENTY = 64 * GiB


def _no_weights(*_: object) -> None:
    raise AssertionError("the resolver must not read weights")


def weightless(source: ModelSource) -> ModelSource:
    raw = None if source.raw_weights is None else _no_weights
    return dataclasses.replace(source, weights=_no_weights, raw_weights=raw)


@pytest.fixture(scope="module")
def stories() -> ModelSource:
    return weightless(open_model_source("stories260k"))


@pytest.fixture(scope="module")
def smollm2_gguf() -> ModelSource:
    return weightless(open_model_source("smollm2-135m-instruct"))


def resolve(source: ModelSource, available: int = PLENTY, **kw: object):  # noqa: ANN201
    return resolve_config(engine_args(**kw), source, available)


def one_line_error(source: ModelSource, available: int = PLENTY, **kw: object) -> str:
    with pytest.raises(TreadleError) as info:
        resolve(source, available, **kw)
    message = str(info.value)
    assert message and "\n" not in message
    return message


def test_defaults_resolve_to_concrete_values(stories: ModelSource) -> None:
    cfg = resolve(stories)
    limit = stories.config.max_position_embeddings  # 512
    assert cfg.model == stories.config and cfg.load.model_path == str(stories.path)
    assert (cfg.load.dtype, cfg.load.quantization, cfg.load.seed) == ("float32", "none", 0)
    assert cfg.scheduler.max_model_len == limit
    assert cfg.scheduler.max_num_seqs == EngineArgs.max_num_seqs
    assert cfg.scheduler.max_num_batched_tokens == EngineArgs.max_num_batched_tokens
    assert cfg.scheduler.enable_chunked_prefill and cfg.cache.enable_prefix_caching
    assert cfg.cache.block_size == EngineArgs.block_size
    # a share of free memory, but never more than max_num_seqs full-length sequences use
    assert cfg.cache.num_blocks == EngineArgs.max_num_seqs * -(-limit // EngineArgs.block_size)
    assert (cfg.device, cfg.attention_backend, cfg.enforce_eager) == ("cpu", "cpu", True)
    assert cfg.parallel.distributed_executor_backend == "uni" and cfg.parallel.world_size == 1
    assert cfg.fused_layers


def test_auto_quantization_follows_the_checkpoint_and_device(stories: ModelSource, smollm2_gguf: ModelSource) -> None:
    assert resolve(smollm2_gguf).load.quantization == "gguf"  # GGUF on the CPU keeps its blocks
    assert resolve(stories).load.quantization == "none"
    on_gpu = resolve(smollm2_gguf, device="cuda")  # pure: no GPU needed to resolve for one
    assert on_gpu.load.quantization == "none" and not on_gpu.enforce_eager
    assert on_gpu.attention_backend in ("triton", "reference")
    assert resolve(stories, quantization="int4").load.quantization == "int4-g32"
    assert "needs a .gguf file" in one_line_error(stories, quantization="gguf")
    assert "CPU only" in one_line_error(smollm2_gguf, quantization="gguf", device="cuda")


def test_auto_dtype_is_float32_and_explicit_dtypes_stay(stories: ModelSource, smollm2_gguf: ModelSource) -> None:
    assert resolve(stories, dtype="auto").load.dtype == "float32"
    assert resolve(smollm2_gguf, dtype="auto").load.dtype == "float32"
    assert resolve(stories, dtype="bfloat16").load.dtype == "bfloat16"


def test_gguf_weights_count_as_the_file_size(smollm2_gguf: ModelSource) -> None:
    """Native GGUF keeps its blocks: the KV budget is what is left after the file, not after
    a float32 copy of the weights (which would not fit here at all)."""
    file_size = smollm2_gguf.path.stat().st_size
    per_block = resolve(smollm2_gguf, num_kv_blocks=1).cache.bytes_per_block
    available = file_size + 20 * per_block
    assert weight_bytes(smollm2_gguf.config, parse_dtype("float32")) > available
    cfg = resolve(smollm2_gguf, available, max_model_len=64)
    assert cfg.cache.num_blocks == 10  # half of what is left after the weights



def test_quantized_checkpoint_weights_count_as_its_files(tmp_path) -> None:
    """A published int4 checkpoint keeps its packed weights: the KV budget is what is left
    after its files, not after a float32 copy (which would leave no room for any block)."""
    from quant_checkpoints import write_compressed_tensors

    from treadle.loaders.hf import weight_files

    source = weightless(open_model_source(write_compressed_tensors(tmp_path / "w4a16", "int4-g32-sym")))
    files = sum(f.stat().st_size for f in weight_files(source.path))
    per_block = resolve(source, num_kv_blocks=1).cache.bytes_per_block
    available = files + 20 * per_block
    assert weight_bytes(source.config, parse_dtype("float32")) > available
    assert resolve(source, available, max_model_len=64).cache.num_blocks == 10

def test_kv_budget_is_capped(stories: ModelSource) -> None:
    per_block = resolve(stories, num_kv_blocks=1).cache.bytes_per_block
    # many sequences and lots of memory: the CPU cap binds
    assert resolve(stories, max_num_seqs=100_000).cache.num_blocks == CPU_DEFAULT_CAP // per_block
    # an explicit size, or an exact count
    assert resolve(stories, kv_cache_memory="1MiB").cache.num_blocks == (1 << 20) // per_block
    assert resolve(stories, kv_cache_memory=40 * per_block).cache.num_blocks == 40
    assert resolve(stories, num_kv_blocks=7).cache.num_blocks == 7
    weights = weight_bytes(stories.config, parse_dtype("float32"))
    half = resolve(stories, weights + 2 * 30 * per_block, kv_cache_memory_fraction=0.5).cache.num_blocks
    assert half == 30
    assert "only" in one_line_error(stories, kv_cache_memory="1TiB")
    assert "needs" in one_line_error(stories, available=weights)


def test_max_model_len_is_clamped_and_sizes_unchunked_steps(stories: ModelSource) -> None:
    limit = stories.config.max_position_embeddings
    assert resolve(stories, max_model_len=100).scheduler.max_model_len == 100
    assert resolve(stories, max_model_len=10 * limit).scheduler.max_model_len == limit
    sched = resolve(stories, max_num_batched_tokens=64, enable_chunked_prefill=False).scheduler
    assert sched.max_num_batched_tokens == limit  # a whole prompt must fit one step
    assert resolve(stories, max_num_batched_tokens=64).scheduler.max_num_batched_tokens == 64


@pytest.mark.parametrize(("kw", "fragment"), [
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(block_size=0), "block_size"),
    (dict(max_model_len=0), "max_model_len"),
    (dict(num_kv_blocks=0), "num_kv_blocks"),
    (dict(kv_cache_memory_fraction=0.0), "kv_cache_memory_fraction"),
    (dict(kv_cache_memory="lots"), "memory size"),
    (dict(dtype="float64"), "dtype"),
    (dict(device="abacus"), "device"),
    (dict(quantization="int3"), "int3"),
    (dict(attention_backend="flash"), "attention backend"),
    (dict(distributed_executor_backend="threads"), "distributed_executor_backend"),
    (dict(tensor_parallel_size=3), "valid sizes: 1, 2, 4, 8"),
    (dict(pipeline_parallel_size=40), "more than the model's"),
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size"),
    (dict(seed=2**64), "seed must be in"),
    (dict(seed=None), "seed must be an integer"),
    (dict(max_model_len="big"), "max_model_len must be an integer"),
    (dict(kv_cache_memory_fraction="half"), "kv_cache_memory_fraction must be a number"),
    (dict(kv_cache_memory="1KiB"), "kv_cache_memory 1.0 KiB holds no KV block"),
])
def test_bad_values_are_one_line_errors(stories: ModelSource, kw: dict, fragment: str) -> None:
    assert fragment in one_line_error(stories, **kw)


def test_unknown_engine_argument_is_one_line_error() -> None:
    with pytest.raises(TreadleError, match="unknown engine argument 'max_batch'"):
        engine_args("stories260k", max_batch=4)


def test_cli_defaults_are_engine_args_defaults() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser, model_positional=True)
    assert EngineArgs(**engine_kwargs(parser.parse_args([]))) == EngineArgs()
    args = parser.parse_args(["stories260k", "--no-enable-chunked-prefill", "--max-model-len", "128",
                              "--kv-cache-memory", "64MiB", "-tp", "1", "--distributed-executor-backend", "mp"])
    got = EngineArgs(**engine_kwargs(args))
    assert got == EngineArgs(model="stories260k", enable_chunked_prefill=False, max_model_len=128,
                             kv_cache_memory="64MiB", distributed_executor_backend="mp")


def test_parallel_sizes_are_checked_against_the_heads(stories: ModelSource, smollm2_gguf: ModelSource) -> None:
    message = one_line_error(smollm2_gguf, tensor_parallel_size=2)  # 9 heads, 3 KV heads
    assert message.endswith("valid sizes: 1, 3, 9")
    config = resolve(stories, PLENTY, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert config.parallel.world_size == 4
    assert config.parallel.distributed_executor_backend == "mp"  # several ranks need processes
    single = resolve(stories, PLENTY)
    # each rank holds half the KV heads of its stage's layers (5 layers: stages of 2 and 3)
    assert config.cache.bytes_per_block == single.cache.bytes_per_block // 5 * 3 // 2


def test_eagle_blocks_count_the_head_kv_and_a_hidden_state_per_slot(stories: ModelSource) -> None:
    """A block holds the target's KV, the EAGLE layer's KV and, for the head's lazy catch-up, the
    target's hidden state of each of its slots."""
    plain = resolve(stories, num_kv_blocks=1).cache
    eagle = resolve(stories, num_kv_blocks=1, speculative_config={"method": "eagle", "num_speculative_tokens": 4})
    head = draft_head_kv_config(eagle.speculative, stories)
    assert head is not None
    bs, f32 = plain.block_size, parse_dtype("float32")
    assert eagle.cache.bytes_per_block == (plain.bytes_per_block + bytes_per_block(head, bs, f32)
                                           + bs * stories.config.hidden_size * 4)
