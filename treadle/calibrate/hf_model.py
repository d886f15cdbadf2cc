"""The float checkpoint as a transformers model (calibration runs on it), and the
Hugging Face config and tokenizer files that go into the output directory."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from treadle.config import ModelConfig, TreadleError
from treadle.loaders.source import ModelSource

TRANSFORMERS_HINT = "treadle quantize needs transformers and compressed-tensors: pip install transformers compressed-tensors"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "chat_template.jinja", "generation_config.json")
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}


def require_transformers() -> None:
    try:
        import compressed_tensors  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise TreadleError(TRANSFORMERS_HINT) from None


def hf_config_dict(source: ModelSource) -> dict[str, Any]:
    """config.json of an HF directory as it is, or one written from a GGUF's ModelConfig."""
    if source.path.is_dir():
        cfg = json.loads((source.path / "config.json").read_text())
        if "quantization_config" in cfg:
            raise TreadleError(f"{source.path}: already quantized ({cfg['quantization_config'].get('quant_method')}); "
                               "give a float checkpoint")
        return cfg
    return _config_from_model_config(source.config)


def _config_from_model_config(c: ModelConfig) -> dict[str, Any]:
    if c.architecture not in _MODEL_TYPES or c.rope_scaling is not None:
        raise TreadleError(f"{c.architecture} from GGUF (rope scaling {c.rope_scaling}) cannot be quantized yet; "
                           f"supported: {', '.join(_MODEL_TYPES)} without rope scaling")
    return {
        "architectures": [c.architecture], "model_type": _MODEL_TYPES[c.architecture],
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings, "attention_bias": c.qkv_bias, "mlp_bias": False,
        "hidden_act": "silu", "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_ids) if len(c.eos_token_ids) != 1 else c.eos_token_ids[0],
        "dtype": "float32",
    }


def build_hf_model(source: ModelSource, config: dict[str, Any]) -> torch.nn.Module:
    """transformers' causal LM on the source's float weights (float32, eval mode)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model(**config)
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    weights = {name: t.to(torch.float32) for name, t in source.weights()}
    if config.get("tie_word_embeddings"):
        weights.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.get("tie_word_embeddings"))]
    if missing or unexpected:
        raise TreadleError(f"{source.path}: weights do not match {config['architectures'][0]} "
                           f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model.eval()


def copy_tokenizer_files(source: ModelSource, out: Path) -> None:
    """Tokenizer (and generation config) files beside the weights: copied from an HF
    directory, written from the GGUF's vocabulary otherwise."""
    if source.path.is_dir():
        for name in _TOKENIZER_FILES:
            if (source.path / name).is_file():
                shutil.copy2(source.path / name, out / name)
        return
    tok = source.tokenizer
    if tok is None:
        raise TreadleError(f"{source.path}: no tokenizer to copy")
    tok.backend.save(str(out / "tokenizer.json"))
    tok_cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token,
                               "eos_token": tok.eos_token, "clean_up_tokenization_spaces": False}
    if tok.chat_template:
        tok_cfg["chat_template"] = tok.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    gen = {"bos_token_id": source.config.bos_token_id, "eos_token_id": list(source.config.eos_token_ids)}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
