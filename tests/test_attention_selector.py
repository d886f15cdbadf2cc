"""Backend selection by name and device, and the CUDA-graph runner's CPU-visible contract."""
from __future__ import annotations

import pytest
import torch

from treadle.config import ModelConfig, TreadleError
from treadle.layers.attention import ReferenceBackend, build_attention_metadata
from treadle.layers.attention.selector import BACKEND_NAMES, resolve_backend_name, select_backend
from treadle.models.llama import LlamaForCausalLM
from treadle.worker.cuda_graph import CUDAGraphRunner, default_buckets, maybe_graph_runner


def test_auto_resolves_by_device() -> None:
    assert resolve_backend_name("auto", "cpu") == "cpu"
    assert resolve_backend_name("auto", torch.device("cuda", 0)) == "triton"  # triton is a test dependency
    assert resolve_backend_name("reference", "cuda") == "reference"


def test_backends_are_built_by_name() -> None:
    assert isinstance(select_backend("reference", "cpu"), ReferenceBackend)
    assert select_backend("cpu", "cpu").name == "cpu"
    assert select_backend("auto", "cpu").name == "cpu"


def test_unknown_backend_lists_the_choices() -> None:
    with pytest.raises(TreadleError) as err:
        select_backend("flash", "cpu")
    for name in BACKEND_NAMES:
        assert name in str(err.value)


def test_default_buckets_cover_every_batch_size() -> None:
    assert default_buckets(1) == [1]
    assert default_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    buckets = default_buckets(100)
    assert buckets[-1] == 100 and buckets == sorted(set(buckets))
    assert all(any(b >= n for b in buckets) for n in range(1, 101))


def _model() -> LlamaForCausalLM:
    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
        num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=128, tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg, ReferenceBackend())


def test_graph_runner_is_off_when_eager_or_not_cuda() -> None:
    caches = [(torch.randn(4, 16, 2, 8), torch.randn(4, 16, 2, 8))]
    assert maybe_graph_runner(True, "cuda", _model(), caches, 8, 4, 16) is None
    assert maybe_graph_runner(False, "cpu", _model(), caches, 8, 4, 16) is None


def test_uncaptured_runner_declines_every_step() -> None:
    runner = CUDAGraphRunner(_model(), [], max_num_seqs=8, max_blocks_per_seq=4, block_size=16, device="cpu")
    assert runner.buckets == [1, 2, 4, 8]
    assert runner.bucket_for(3) == 4 and runner.bucket_for(8) == 8
    decode = build_attention_metadata([1, 1], [20, 7], [[3, 1], [2]], 16)
    assert not runner.can_run(decode)  # nothing captured yet
