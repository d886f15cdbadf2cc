"""GGUF mixtures of experts: Mixtral (``llama`` with ``llama.expert_count``), ``qwen2moe`` and
``qwen3moe``, as llama.cpp's converter writes them::

    blk.N.ffn_gate_inp.weight            [E, hidden]        router            -> mlp.gate / block_sparse_moe.gate
    blk.N.ffn_{gate,up,down}_exps.weight [E, I, hidden] ... every expert stacked -> one HF tensor per expert
    blk.N.ffn_{gate,up,down}_shexp       Qwen2-MoE's shared expert
    blk.N.ffn_gate_inp_shexp.weight      [hidden]           its gate          -> mlp.shared_expert_gate [1, hidden]

A stacked tensor becomes E refs (``GGUFTensorRef.expert``: the slice of the first axis each one
reads), so the rest of loading sees the Hugging Face checkpoint's names. Qwen files keep q/k in
Hugging Face's order (llama.cpp runs them with NEOX RoPE); Mixtral's are permuted like Llama's.
llama.cpp runs every qwen layer sparse (no ``mlp_only_layers``); a layer without a router here
is read as a dense one. The router's top-k renormalization follows
``{arch}.expert_weights_norm`` when the file has it, else llama.cpp's per-architecture choice.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from treadle.config import ModelConfig, MoEConfig, RopeScaling, TreadleError

ARCHITECTURES = {"llama": "MixtralForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True}  # llama.cpp's builders
_ATTENTION = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_QWEN = _ATTENTION | {
    "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
LAYER_NAMES = {"llama": _ATTENTION | {"ffn_gate_inp": "block_sparse_moe.gate"}, "qwen2moe": _QWEN, "qwen3moe": _QWEN}
# stacked experts -> (HF module of expert {e}, projection)
EXPERT_NAMES = {
    "llama": {"ffn_gate_exps": "block_sparse_moe.experts.{e}.w1", "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
              "ffn_down_exps": "block_sparse_moe.experts.{e}.w2"},
    "qwen2moe": {f"ffn_{p}_exps": f"mlp.experts.{{e}}.{p}_proj" for p in ("gate", "up", "down")},
}
EXPERT_NAMES["qwen3moe"] = EXPERT_NAMES["qwen2moe"]


def is_moe(md: dict[str, Any]) -> bool:
    arch = md.get("general.architecture")
    return arch in ("qwen2moe", "qwen3moe") or (arch == "llama" and bool(md.get("llama.expert_count")))


def moe_model_config(md: dict[str, Any], tensor_names: set[str], path: Path,
                     rope_scaling: RopeScaling | None) -> ModelConfig:
    arch = str(md["general.architecture"])
    if any(".ffn_gate." in n and n.split(".")[2].isdigit() for n in tensor_names):
        raise TreadleError(f"{path}: experts stored one tensor each (an old Mixtral GGUF) are not supported; "
                           "convert it again with llama.cpp")
    try:
        layers, heads, hidden = (int(md[f"{arch}.{k}"]) for k in ("block_count", "attention.head_count",
                                                                 "embedding_length"))
        experts_ff = md.get(f"{arch}.expert_feed_forward_length") or md[f"{arch}.feed_forward_length"]
        sparse = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_names]
        moe = MoEConfig(
            num_experts=int(md[f"{arch}.expert_count"]), top_k=int(md[f"{arch}.expert_used_count"]),
            intermediate_size=int(experts_ff),
            norm_topk_prob=bool(md.get(f"{arch}.expert_weights_norm", _NORM_TOPK[arch])),
            shared_expert_intermediate_size=int(md.get(f"{arch}.expert_shared_feed_forward_length") or 0),
            mlp_only_layers=tuple(i for i in range(layers) if i not in sparse),
        )
        eos = md.get("tokenizer.ggml.eos_token_id")
        return ModelConfig(
            architecture=ARCHITECTURES[arch],
            vocab_size=int(md.get(f"{arch}.vocab_size") or len(md["tokenizer.ggml.tokens"])),
            hidden_size=hidden,
            intermediate_size=int(md.get(f"{arch}.feed_forward_length") or experts_ff),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(md.get(f"{arch}.attention.head_count_kv") or heads),
            head_dim=int(md.get(f"{arch}.attention.key_length") or hidden // heads),
            rms_norm_eps=float(md[f"{arch}.attention.layer_norm_rms_epsilon"]),
            rope_theta=float(md.get(f"{arch}.rope.freq_base", 10000.0)),
            max_position_embeddings=int(md.get(f"{arch}.context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensor_names,
            qkv_bias="blk.0.attn_q.bias" in tensor_names,
            rope_scaling=rope_scaling,
            bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
            moe=moe,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise TreadleError(f"{path}: missing or invalid metadata {e}") from None


def hf_names(gguf_name: str, arch: str, num_experts: int) -> list[tuple[str, int | None]]:
    """A GGUF tensor's Hugging Face name(s), each with the expert slice it reads (None: the
    whole tensor); [] when the name has no place in the model."""
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit():
        return []
    prefix = f"model.layers.{parts[1]}"
    if parts[2] in EXPERT_NAMES[arch]:
        module = EXPERT_NAMES[arch][parts[2]]
        return [(f"{prefix}.{module.format(e=e)}.{parts[3]}", e) for e in range(num_experts)]
    if parts[2] not in LAYER_NAMES[arch]:
        return []
    return [(f"{prefix}.{LAYER_NAMES[arch][parts[2]]}.{parts[3]}", None)]
