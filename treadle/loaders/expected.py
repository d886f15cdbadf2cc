"""The tensors a Llama-family checkpoint must hold, by Hugging Face name and shape.

Checked against a file's header before any weight is read, so a missing, extra or
misshapen tensor is one clear error naming the file, not a traceback mid-load or a
model silently running on uninitialised memory.
"""
from __future__ import annotations

from pathlib import Path

from treadle.config import ModelConfig, TreadleError

Shape = tuple[int, ...]


def expected_llama_tensors(cfg: ModelConfig) -> dict[str, Shape]:
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes: dict[str, Shape] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (q, h),
            f"{p}.self_attn.k_proj.weight": (kv, h),
            f"{p}.self_attn.v_proj.weight": (kv, h),
            f"{p}.self_attn.o_proj.weight": (h, q),
            f"{p}.mlp.gate_proj.weight": (cfg.intermediate_size, h),
            f"{p}.mlp.up_proj.weight": (cfg.intermediate_size, h),
            f"{p}.mlp.down_proj.weight": (h, cfg.intermediate_size),
        }
        if cfg.qkv_bias:
            shapes |= {f"{p}.self_attn.q_proj.bias": (q,), f"{p}.self_attn.k_proj.bias": (kv,), f"{p}.self_attn.v_proj.bias": (kv,)}
    return shapes


def is_ignored(name: str, cfg: ModelConfig) -> bool:
    """Tensors a checkpoint may carry that the model does not use (never read)."""
    return name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight")


def check_tensors(path: Path, found: dict[str, Shape], cfg: ModelConfig) -> None:
    """Raise TreadleError unless ``found`` (name -> shape) is exactly what the model needs."""
    expected = expected_llama_tensors(cfg)
    for name, shape in found.items():
        if is_ignored(name, cfg):
            continue
        if name not in expected:
            raise TreadleError(f"{path}: unexpected tensor {name!r} for {cfg.architecture}")
        if tuple(shape) != expected[name]:
            raise TreadleError(f"{path}: tensor {name!r} has shape {tuple(shape)}, the config implies {expected[name]}")
    missing = [name for name in expected if name not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise TreadleError(f"{path}: tensor {missing[0]!r} is missing{more}")
