"""Write a random Mixtral-shaped mixture of experts and a dense Llama with the same active
parameters per token (Hugging Face directories made with transformers), for the MoE decode
cost measurement in docs/models.md; random weights, so only speed is meaningful. Usage:

    .venv/bin/python benchmarks/make_random_moe.py [OUT_DIR]   # default /tmp/treadle-bench

Both: hidden 768, 8 layers, 12 heads (4 KV heads), vocab 32000. The MoE: 8 experts of
intermediate 1024, top-2 (per token 2 x 1024 = 2048 active MLP columns; 8 x 1024 held).
The dense model: intermediate 2048. Active parameters per token are the same (~93M with the
embedding and lm_head); the MoE holds 3.4x the MLP weights.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

SHAPE = dict(vocab_size=32000, hidden_size=768, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4,
             max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)


def main(root: Path) -> None:
    import transformers
    from make_random_llama import write_tokenizer

    for name, cfg in (
        ("random-moe-8x1024-top2", transformers.MixtralConfig(**SHAPE, intermediate_size=1024, num_local_experts=8,
                                                              num_experts_per_tok=2)),
        ("random-dense-2048", transformers.LlamaConfig(**SHAPE, intermediate_size=2048)),
    ):
        out = root / name
        if (out / "config.json").is_file():
            print(f"{out} exists; keeping it")
            continue
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        model.save_pretrained(out)
        write_tokenizer(out)
        print(f"wrote {out}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/treadle-bench"))
