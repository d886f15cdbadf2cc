"""`treadle quantize`: calibrate a float checkpoint and write a compressed-tensors one."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from treadle.calibrate.spec import METHODS


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "quantize",
        help="quantize a float checkpoint (SmoothQuant W8A8, GPTQ, AWQ, RTN) into a compressed-tensors directory",
        description="Read MODEL (HF directory, GGUF file dequantized to float, or a short name), calibrate "
        "on a text file and write OUT: config.json with quantization_config, model.safetensors and the "
        "tokenizer files. Needs transformers and compressed-tensors.",
    )
    parser.add_argument("model", metavar="MODEL")
    parser.add_argument("out", type=Path, metavar="OUT")
    parser.add_argument("--method", required=True, choices=METHODS)
    parser.add_argument("--bits", type=int, choices=(4, 8), default=None,
                        help="8: int8 per-channel weights (W8A8 for smoothquant/rtn); 4: int4 groups (W4A16)")
    parser.add_argument("--group-size", type=int, default=None, help="int4 group size: 32, 64 or 128 (default 128)")
    parser.add_argument("--alpha", type=float, default=0.8, help="SmoothQuant migration strength (default 0.8)")
    parser.add_argument("--act-order", action="store_true", help="GPTQ: quantize columns by decreasing activation")
    parser.add_argument("--calibration", type=Path, default=None, metavar="FILE", help="calibration text file")
    parser.add_argument("--num-samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from treadle.calibrate.pipeline import quantize_checkpoint
    from treadle.calibrate.spec import QuantizeSpec

    spec = QuantizeSpec.build(args.method, args.bits, args.group_size, args.alpha, args.num_samples, args.seq_len,
                              args.act_order)
    quantize_checkpoint(args.model, args.out, args.calibration, spec)
    print(f"wrote {args.out}")
    return 0
