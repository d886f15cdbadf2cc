"""`treadle convert`: turn a foreign checkpoint into a Hugging Face model directory."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="convert a llama2.c checkpoint into a Hugging Face model directory",
        description="Write OUT_DIR with model.safetensors, config.json, generation_config.json, "
        "tokenizer.json and tokenizer_config.json.",
    )
    parser.add_argument("--llama2c", type=Path, required=True, metavar="CKPT.bin", help="llama2.c checkpoint (version 0)")
    parser.add_argument("--tokenizer", type=Path, required=True, metavar="TOK.bin", help="llama2.c tokenizer.bin")
    parser.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from treadle.loaders.llama2c import convert_llama2c

    convert_llama2c(args.llama2c, args.tokenizer, args.out_dir)
    print(f"wrote {args.out_dir}")
    return 0
