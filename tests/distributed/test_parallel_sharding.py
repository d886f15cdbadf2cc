"""Tensor-parallel sharding rules, without processes: every rank's part of every checkpoint
tensor, put back together, is the tensor (replicated KV heads and padded vocabulary rows
aside), and quantized blocks split only at block boundaries."""
from __future__ import annotations

import pytest
import torch

from treadle.config import ModelConfig, TreadleError
from treadle.distributed.sharding import check_parallel_sizes, partition, shard_config, stage_layers, valid_tp_sizes
from treadle.models.layout import Split
from treadle.models.llama import LLAMA_LAYOUT
from treadle.models.phi3 import PHI3_LAYOUT
from treadle.models.rank_shard import RankSharder
from treadle.quantization.methods.gguf_native import dequantize_blocks, quantize_blocks


def config(heads: int = 4, kv: int = 2, vocab: int = 259, inter: int = 192, **kw: object) -> ModelConfig:
    hf = dict(vocab_size=vocab, hidden_size=64, intermediate_size=inter, num_hidden_layers=3,
              num_attention_heads=heads, num_key_value_heads=kv, architectures=["Qwen2ForCausalLM"], **kw)
    return ModelConfig.from_hf(hf)


def checkpoint(cfg: ModelConfig, layout=LLAMA_LAYOUT) -> dict[str, torch.Tensor]:  # noqa: ANN001
    torch.manual_seed(0)
    return {name: torch.randn(shape) for name, shape in layout.expected_tensors(cfg).items()}


def test_valid_sizes_follow_the_head_counts() -> None:
    assert valid_tp_sizes(config(heads=9, kv=3)) == [1, 3, 9]  # SmolLM2
    assert valid_tp_sizes(config(heads=8, kv=4)) == [1, 2, 4, 8]  # stories260K
    with pytest.raises(TreadleError, match="valid sizes: 1, 3, 9$"):
        check_parallel_sizes(config(heads=9, kv=3), 2, 1)
    check_parallel_sizes(config(heads=9, kv=3), 9, 3)


def test_partitions_cover_the_whole() -> None:
    for total, parts, unit in [(1536, 9, 32), (172, 2, 1), (5, 2, 1), (128, 4, 32)]:
        pieces = [partition(total, parts, i, unit) for i in range(parts)]
        assert pieces[0][0] == 0 and sum(size for _, size in pieces) == total
        assert all(a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:]))
        assert all(start % unit == 0 for start, _ in pieces)
    assert [list(stage_layers(5, 2, s)) for s in range(2)] == [[0, 1], [2, 3, 4]]


@pytest.mark.parametrize(("tp", "kv"), [(2, 2), (4, 2), (2, 1)])
def test_rank_parts_put_together_are_the_checkpoint(tp: int, kv: int) -> None:
    cfg = config(kv=kv)
    full = checkpoint(cfg)
    shards = [{name: RankSharder(LLAMA_LAYOUT, cfg, tp, r)(name, t) for name, t in full.items()} for r in range(tp)]
    local = [shard_config(cfg, tp, r) for r in range(tp)]
    for name, tensor in full.items():
        lin, _ = LLAMA_LAYOUT.linear_for(name)
        parts = [s[name] for s in shards]
        if lin is not None and lin.split == Split.ROW:
            assert torch.equal(torch.cat(parts, dim=1), tensor)
        elif name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")) and tp > kv:
            per_head = tensor.shape[0] // kv
            for r, part in enumerate(parts):  # replicated: rank r holds KV head r * kv // tp
                head = r * kv // tp
                assert torch.equal(part, tensor[head * per_head : (head + 1) * per_head])
        elif lin is not None:
            assert torch.equal(torch.cat(parts), tensor)
        elif name.startswith(("model.embed_tokens", "lm_head")):
            assert all(p.shape[0] == local[0].vocab_size for p in parts)
            assert torch.equal(torch.cat(parts)[: cfg.vocab_size], tensor)  # zero padding cut off
        else:
            assert all(torch.equal(p, tensor) for p in parts)  # norms: replicated


def test_packed_checkpoint_layers_are_cut_part_by_part() -> None:
    cfg = config(kv=2)
    full = checkpoint(cfg, PHI3_LAYOUT)
    name = "model.layers.1.self_attn.qkv_proj.weight"
    q, k, v = full[name].split([64, 32, 32])  # 4 heads and 2 KV heads of 16
    r1 = RankSharder(PHI3_LAYOUT, cfg, 2, 1)(name, full[name])
    assert torch.equal(r1, torch.cat([q[32:], k[16:], v[16:]]))


def test_quantized_blocks_split_at_block_boundaries() -> None:
    cfg = config(inter=256)
    torch.manual_seed(1)
    down = torch.randn(64, 256)
    blocks = quantize_blocks(down, "Q4_1")
    name = "model.layers.0.mlp.down_proj.weight"
    parts = [RankSharder(LLAMA_LAYOUT, cfg, 2, r)(name, blocks) for r in range(2)]
    whole = dequantize_blocks(blocks)
    assert torch.equal(torch.cat([dequantize_blocks(p) for p in parts], dim=1), whole)
    assert shard_config(config(inter=48), 2, 0).intermediate_size == 24  # no 32-column unit: 24 each
    o_proj = quantize_blocks(torch.randn(64, 64), "Q8_0")  # 4 heads of 16: 16 columns a rank at T=4
    with pytest.raises(TreadleError, match="GGUF blocks hold 32 inputs"):
        RankSharder(LLAMA_LAYOUT, cfg, 4, 1)("model.layers.0.self_attn.o_proj.weight", o_proj)


def test_a_rank_reads_its_part_of_a_safetensors_file(tmp_path) -> None:  # noqa: ANN001
    from safetensors.torch import save_file

    from treadle.loaders.hf import stream_safetensors

    cfg = config(kv=1)
    full = checkpoint(cfg)
    save_file(full, str(tmp_path / "model.safetensors"))
    shards = [(tmp_path / "model.safetensors", list(full))]
    shapes = {k: tuple(v.shape) for k, v in full.items()}
    for rank in range(2):
        cut = RankSharder(LLAMA_LAYOUT, cfg, 2, rank)
        for name, lazy in stream_safetensors(shards, shapes, cfg, sliced=True):
            assert torch.equal(cut(name, lazy), cut(name, full[name]))


def test_k_quant_super_blocks_split_at_256_inputs() -> None:
    from treadle.quantization.methods.gguf_native import GGUFBlocks

    cfg = config(inter=512)
    gen = torch.Generator().manual_seed(2)
    raw = GGUFBlocks("Q4_K", torch.randint(0, 256, (64, 2 * 144), dtype=torch.uint8, generator=gen), (64, 512))
    raw.data.view(64, 2, 144)[:, :, :4] = 0x3C  # finite float16 scales
    name = "model.layers.0.mlp.down_proj.weight"
    parts = [RankSharder(LLAMA_LAYOUT, cfg, 2, r)(name, raw) for r in range(2)]
    assert torch.equal(torch.cat([dequantize_blocks(p) for p in parts], dim=1), dequantize_blocks(raw))
    with pytest.raises(TreadleError, match="hold 256 inputs"):
        RankSharder(LLAMA_LAYOUT, config(inter=512), 4, 1)(name, raw)  # 128 columns a rank
