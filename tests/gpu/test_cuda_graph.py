"""The CUDA-graph runner's CPU-visible contract: buckets, eager fallback, and padding.

Graphs themselves need CUDA (benchmarks/gpu_check.py replays them); here the staged,
padded bucket is run eagerly with the Triton backend under TRITON_INTERPRET=1, which is
exactly the computation a graph records.
"""
from __future__ import annotations

import torch

from treadle.config import ModelConfig
from treadle.layers.attention import AttentionBackend, ReferenceBackend, build_attention_metadata
from treadle.layers.attention.triton_backend import TritonBackend, TritonTiles
from treadle.models.llama import LlamaForCausalLM
from treadle.worker.cuda_graph import CUDAGraphRunner, default_buckets, maybe_graph_runner

BLOCK_SIZE, NUM_BLOCKS = 16, 12


def tiny_model(backend: AttentionBackend) -> LlamaForCausalLM:
    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=256, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg, backend)
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        w = torch.randn(p.shape, generator=gen)
        p.data.copy_(1.0 + 0.1 * w if p.dim() == 1 else w * p.shape[-1] ** -0.5)
    return model.eval()


def test_default_buckets_cover_every_batch_size() -> None:
    assert default_buckets(1) == [1]
    assert default_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    buckets = default_buckets(100)
    assert buckets[-1] == 100 and buckets == sorted(set(buckets))
    assert all(any(b >= n for b in buckets) for n in range(1, 101))


def test_graph_runner_is_off_when_eager_or_not_cuda() -> None:
    model = tiny_model(ReferenceBackend())
    caches = [(torch.randn(4, BLOCK_SIZE, 2, 16), torch.randn(4, BLOCK_SIZE, 2, 16))]
    assert maybe_graph_runner(True, "cuda", model, caches, 8, 4, BLOCK_SIZE) is None
    assert maybe_graph_runner(False, "cpu", model, caches, 8, 4, BLOCK_SIZE) is None


def test_uncaptured_runner_declines_every_step() -> None:
    runner = CUDAGraphRunner(tiny_model(ReferenceBackend()), [], 8, 4, BLOCK_SIZE, device="cpu")
    assert runner.buckets == [1, 2, 4, 8]
    assert runner.bucket_for(3) == 4 and runner.bucket_for(8) == 8
    decode = build_attention_metadata([1, 1], [20, 7], [[3, 1], [2]], BLOCK_SIZE)
    assert not runner.can_run(decode)  # nothing captured yet


@torch.inference_mode()
def test_padded_bucket_matches_the_unpadded_step() -> None:
    """Three decode rows staged into bucket 4 over stale static buffers: the real rows'
    hidden states and the KV cache come out exactly as an unpadded eager step's."""
    gen = torch.Generator().manual_seed(1)
    model = tiny_model(TritonBackend(TritonTiles(16, 16, 16, 2)))
    lens = [7, 20, 3]
    tables = [[5, 9], [2, 11], [0]]
    caches = [(torch.randn(NUM_BLOCKS, BLOCK_SIZE, 2, 16, generator=gen),
               torch.randn(NUM_BLOCKS, BLOCK_SIZE, 2, 16, generator=gen))]
    prompt = torch.randint(0, 64, (sum(lens),), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lens])
    model(prompt, positions, caches, build_attention_metadata(lens, lens, tables, BLOCK_SIZE))

    ids, pos = torch.randint(0, 64, (3,), generator=gen), torch.tensor(lens)
    meta = build_attention_metadata([1, 1, 1], [n + 1 for n in lens], tables, BLOCK_SIZE)
    eager_caches = [(k.clone(), v.clone()) for k, v in caches]
    want = model(ids, pos, eager_caches, meta)

    runner = CUDAGraphRunner(model, caches, max_num_seqs=8, max_blocks_per_seq=4, block_size=BLOCK_SIZE, device="cpu")
    for buf, high in ((runner.input_ids, 64), (runner.positions, 40), (runner.block_tables, NUM_BLOCKS),
                      (runner.slot_mapping, NUM_BLOCKS * BLOCK_SIZE), (runner.seq_lens, 40)):
        buf.random_(0, high, generator=gen)  # stale contents from "earlier steps"
    size = runner.stage(ids, pos, meta)
    assert size == 4
    got = runner.forward_staged(size)
    assert got.shape[0] == 4 and torch.isfinite(got).all()
    torch.testing.assert_close(got[:3], want, atol=1e-5, rtol=1e-5)
    # the real rows' new K/V agree (to rounding: 4-row vs 3-row matmuls); nothing else moved
    written = meta.slot_mapping
    for (k, v), (ek, ev) in zip(caches, eager_caches):
        for cache, expected in ((k, ek), (v, ev)):
            flat, flat_expected = cache.view(-1, 2, 16), expected.view(-1, 2, 16)
            torch.testing.assert_close(flat[written], flat_expected[written], atol=1e-5, rtol=1e-5)
            flat[written] = flat_expected[written]
            assert torch.equal(cache, expected)  # the padded row wrote nothing
