"""Tiny random Llama-family checkpoints made with transformers at test time (imported by tests
and by conftest.py's fixtures)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["<s>", "</s>"]


def write_byte_tokenizer(path: Path) -> int:
    """A byte-level BPE tokenizer (256 byte tokens + <s>, </s>); returns its vocab size."""
    byte_tokens = list(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIALS + sorted(byte_tokens))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
        "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}",
    }))
    return len(vocab)


def make_tiny_model(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    import transformers

    torch.manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    vocab = write_byte_tokenizer(path)
    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
              bos_token_id=0, eos_token_id=1)
    kw.update(overrides)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    }[arch]
    if arch == "qwen3":
        kw.setdefault("head_dim", kw["hidden_size"] // kw["num_attention_heads"])  # Qwen3's default is 128
    if arch == "phi3":
        kw.setdefault("pad_token_id", None)  # Phi-3's default pad id (32000) is outside a tiny vocabulary
    model = model_cls(config_cls(**kw)).eval()
    with torch.no_grad():  # larger weights than the default init, so tokens vary
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(path)
    return path
