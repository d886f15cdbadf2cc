"""GGUF ``gemma3`` files (llama.cpp's converter): what differs from a ``llama`` file.

- Tensor names: ``ffn_norm`` is the norm *before* the MLP (Llama's post-attention norm), and
  Gemma adds ``post_attention_norm``, ``post_ffw_norm`` and the per-head ``attn_q_norm`` /
  ``attn_k_norm``.
- q/k rows stay in Hugging Face's order (llama.cpp runs Gemma with NEOX-style RoPE, so the
  converter does not permute them).
- Norm weights are stored as the multiplier 1 + w (llama.cpp's RMSNorm multiplies by the weight
  alone); the loader hands them over as Hugging Face's w (``NORM_SHIFT`` subtracted).
- Hyperparameters llama.cpp hard-codes for the architecture unless the file says otherwise:
  every 6th layer full attention, the rest windowed; local RoPE base 10000; the softmax scale
  1 / sqrt(head_dim), except the 62-layer (27B) model's 1 / sqrt(hidden / heads).
- Turns end with ``<end_of_turn>`` as well as EOS; a file without a chat template gets Gemma's
  turn format.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from treadle.config import ModelConfig, RopeScaling, TreadleError

LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
}
NORM_SHIFT = 1.0  # stored norm weight - NORM_SHIFT = Hugging Face's weight

# Gemma's turn format (system text folded into the first user turn, as Gemma's own template does)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{% set ns.system = m['content'] + '\n\n' %}"
    "{% else %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['role'] == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ m['content'] | trim }}<end_of_turn>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
_END_OF_TURN = "<end_of_turn>"


def _layer_types(md: dict[str, Any], layers: int) -> tuple[str, ...]:
    pattern = md.get("gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # one flag per layer (True: sliding)
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [bool((i + 1) % int(pattern)) for i in range(layers)]
    return tuple("sliding_attention" if s else "full_attention" for s in sliding)


def _stop_ids(md: dict[str, Any]) -> tuple[int, ...]:
    eos = md.get("tokenizer.ggml.eos_token_id")
    eot = md.get("tokenizer.ggml.eot_token_id")
    if eot is None:
        tokens = md.get("tokenizer.ggml.tokens") or []
        eot = tokens.index(_END_OF_TURN) if _END_OF_TURN in tokens else None
    return tuple(int(i) for i in (eos, eot) if i is not None)


def gemma3_model_config(md: dict[str, Any], tensor_names: set[str], path: Path,
                        rope_scaling: RopeScaling | None) -> ModelConfig:
    a = "gemma3"
    try:
        heads = int(md[f"{a}.attention.head_count"])
        hidden = int(md[f"{a}.embedding_length"])
        layers = int(md[f"{a}.block_count"])
        head_dim = int(md.get(f"{a}.attention.key_length") or hidden // heads)
        return ModelConfig(
            architecture="Gemma3ForCausalLM",
            vocab_size=int(md.get(f"{a}.vocab_size") or len(md["tokenizer.ggml.tokens"])),
            hidden_size=hidden,
            intermediate_size=int(md[f"{a}.feed_forward_length"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(md.get(f"{a}.attention.head_count_kv") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(md[f"{a}.attention.layer_norm_rms_epsilon"]),
            rope_theta=float(md.get(f"{a}.rope.freq_base", 1_000_000.0)),
            max_position_embeddings=int(md.get(f"{a}.context_length", 32768)),
            tie_word_embeddings="output.weight" not in tensor_names,
            rope_scaling=rope_scaling,
            sliding_window=int(md[f"{a}.attention.sliding_window"]),
            bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_stop_ids(md),
            layer_types=_layer_types(md, layers),
            rope_local_theta=float(md.get(f"{a}.rope.freq_base_swa", 10_000.0)),
            query_pre_attn_scalar=float(hidden // heads if layers == 62 else head_dim),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise TreadleError(f"{path}: missing or invalid metadata {e}") from None
