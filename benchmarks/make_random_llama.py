"""Write a randomly initialised Llama of about 150M parameters (a Hugging Face
directory made with transformers) for benchmarks/docs; the weights are random,
so only speed is meaningful. Usage:

    .venv/bin/python benchmarks/make_random_llama.py [OUT_DIR]   # default /tmp/treadle-bench/random-llama-150m

Shape: hidden 768, 14 layers, 12 heads (4 KV heads, GQA), MLP 2304, vocab
32000, untied lm_head, 2048 positions -> 145M parameters (581 MB in float32).
The tokenizer is byte-level (256 bytes + <s>, </s>) padded with filler tokens
to the model's vocabulary, so every id decodes.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

VOCAB = 32000
SHAPE = dict(hidden_size=768, intermediate_size=2304, num_hidden_layers=14, num_attention_heads=12,
             num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=False)


def write_tokenizer(out: Path) -> None:
    specials = ["<s>", "</s>"]
    tokens = specials + sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens += [f"<x{i}>" for i in range(VOCAB - len(tokens))]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                           "add_bos_token": True}))


def main(out: Path) -> Path:
    import transformers

    if (out / "config.json").is_file():
        print(f"{out} exists; keeping it")
        return out
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, **SHAPE)
    model = transformers.LlamaForCausalLM(cfg).eval()
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    write_tokenizer(out)
    print(f"wrote {out}: {n / 1e6:.0f}M parameters")
    return out


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/treadle-bench/random-llama-150m"))
