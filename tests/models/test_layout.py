"""Model layouts: the one table per architecture that loading, tensor checks, weight bytes
and quantized packing read (treadle/models/layout.py)."""
from __future__ import annotations

import pytest

from treadle.config import ModelConfig, TreadleError
from treadle.models.layout import Split
from treadle.models.registry import model_layout, supported_architectures


def config(arch: str, **kw) -> ModelConfig:  # noqa: ANN003
    raw = {"architectures": [arch], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    return ModelConfig.from_hf(raw | kw)


def test_every_architecture_has_a_layout() -> None:
    for arch in supported_architectures():
        assert model_layout(arch).expected_tensors(config(arch))


def test_llama_packs_q_k_v_and_gate_up_from_separate_tensors() -> None:
    lay = model_layout("LlamaForCausalLM")
    assert lay.parameter_for("model.layers.3.self_attn.k_proj.weight") == ("layers.3.self_attn.qkv_proj.weight", 1)
    assert lay.parameter_for("model.layers.0.self_attn.q_proj.bias") == ("layers.0.self_attn.qkv_proj.bias", 0)
    assert lay.parameter_for("model.layers.0.mlp.up_proj.weight") == ("layers.0.mlp.gate_up_proj.weight", 1)
    assert lay.parameter_for("model.layers.0.mlp.down_proj.weight") == ("layers.0.mlp.down_proj.weight", None)
    assert lay.parameter_for("model.norm.weight") == ("norm.weight", None)
    assert lay.shard_names("model.layers.1.mlp.gate_up_proj") == [
        "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    assert lay.shard_names("lm_head") == ["lm_head.weight"]
    cfg = config("LlamaForCausalLM", head_dim=32)
    assert [lay.in_features(cfg, f"model.layers.0.{n}") for n in ("self_attn.qkv_proj", "self_attn.o_proj",
                                                                   "mlp.down_proj")] == [64, 128, 96]


def test_phi3_checkpoint_holds_the_packed_tensors() -> None:
    lay, cfg = model_layout("Phi3ForCausalLM"), config("Phi3ForCausalLM")
    shapes = lay.expected_tensors(cfg)
    assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == (64 + 2 * 32, 64)
    assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == (2 * 96, 64)
    assert not any("q_proj" in n or "gate_proj" in n for n in shapes)
    assert lay.parameter_for("model.layers.1.self_attn.qkv_proj.weight") == ("layers.1.self_attn.qkv_proj.weight", None)
    assert lay.linear("self_attn.qkv_proj").output_sizes(cfg) == [64, 32, 32]  # still split for q/k/v (and TP)


def test_qwen3_norms_and_no_bias() -> None:
    lay, cfg = model_layout("Qwen3ForCausalLM"), config("Qwen3ForCausalLM", head_dim=32, attention_bias=False)
    shapes = lay.expected_tensors(cfg)
    assert shapes["model.layers.1.self_attn.q_norm.weight"] == (32,)
    assert shapes["model.layers.1.self_attn.k_norm.weight"] == (32,)
    assert not any(n.endswith(".bias") for n in shapes)
    assert not lay.has_standard_block and model_layout("LlamaForCausalLM").has_standard_block


def test_tied_head_splits_and_weight_bytes() -> None:
    lay = model_layout("Qwen2ForCausalLM")
    tied, untied = config("Qwen2ForCausalLM", tie_word_embeddings=True), config("Qwen2ForCausalLM")
    assert "lm_head.weight" not in lay.expected_tensors(tied) and lay.is_ignored("lm_head.weight", tied)
    assert lay.weight_bytes(untied, 2) - lay.weight_bytes(tied, 2) == 100 * 64 * 2
    # the formula the engine used before the table: layers, embedding (+ head), final norm; plus qkv biases
    h, q, kv, inter = 64, 64, 32, 96
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h + (q + 2 * kv)
    assert lay.weight_bytes(untied, 4) == (2 * per_layer + 2 * 100 * h + h) * 4
    splits = lay.splits()
    assert splits["model.layers.*.self_attn.qkv_proj"] == Split.COLUMN and splits["model.layers.*.mlp.down_proj"] == Split.ROW
    assert splits["model.embed_tokens"] == splits["lm_head"] == Split.VOCAB
    assert splits["model.layers.*.input_layernorm"] == Split.REPLICATED


def test_unsupported_phi3_rope_is_one_clear_error() -> None:
    with pytest.raises(TreadleError, match="longrope"):
        config("Phi3ForCausalLM", rope_scaling={"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]})
    with pytest.raises(TreadleError, match="partial rotary"):
        config("Phi3ForCausalLM", partial_rotary_factor=0.5)
