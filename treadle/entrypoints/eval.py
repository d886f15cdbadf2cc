"""`treadle eval perplexity` (one model on a text) and `treadle eval table` (the accuracy
table of docs/benchmarks-archive.md): see treadle.bench.perplexity for the method."""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from treadle.engine.args import KV_CACHE_DTYPES

DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "assets" / "text" / "eval.txt"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("eval", help="accuracy: perplexity on a text, the quantization table")
    sub = parser.add_subparsers(dest="eval_command", required=True)
    ppl = sub.add_parser("perplexity", help="perplexity of MODEL on a text, agreement with a reference model",
                         description="Sliding windows over the text through Treadle's own forward; prints "
                         "perplexity, top-1 agreement and mean |delta logit| against --reference (default: MODEL "
                         "without quantization), weight MB and the median decode step.")
    ppl.add_argument("model", metavar="MODEL")
    ppl.add_argument("--text", type=Path, default=DEFAULT_TEXT, metavar="FILE",
                     help="evaluation text (default: the bundled treadle/assets/text/eval.txt)")
    ppl.add_argument("--quantization", default=None, help="as for `treadle generate` (gguf, int8, int4-g32, ...)")
    ppl.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                     help="the KV cache's dtype, as for `treadle serve` (the reference keeps a float cache)")
    ppl.add_argument("--reference", default=None, metavar="MODEL", help="float model to compare logits with")
    ppl.add_argument("--no-reference", action="store_true", help="perplexity only")
    ppl.add_argument("--window", type=int, default=512)
    ppl.add_argument("--stride", type=int, default=None, help="default: --window - 1 (windows side by side, overlapping by one token)")
    ppl.add_argument("--json", action="store_true", help="print one JSON object")
    ppl.set_defaults(func=run_perplexity)
    table = sub.add_parser("table", help="the accuracy table (markdown) of docs/benchmarks-archive.md",
                           description="Quantize each model with every method (into --workdir, reused when "
                           "present), evaluate every row on the bundled text and print a markdown table.")
    table.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "stories260k"])
    table.add_argument("--workdir", type=Path, default=Path("quantized"))
    table.add_argument("--text", type=Path, default=DEFAULT_TEXT, metavar="FILE")
    table.add_argument("--no-quantize", action="store_true", help="only rows whose checkpoints are in --workdir")
    table.set_defaults(func=run_table)


def run_perplexity(args: argparse.Namespace) -> int:
    from treadle.bench.accuracy import evaluate_text

    result = evaluate_text(args.model, args.text, args.quantization,
                           None if args.no_reference else (args.reference or args.model), args.window,
                           args.stride or args.window, args.kv_cache_dtype)
    if args.json:
        print(json.dumps(asdict(result)))
        return 0
    for key, value in asdict(result).items():
        print(f"{key:>16}: {value if not isinstance(value, float) else round(value, 4)}")
    return 0


def run_table(args: argparse.Namespace) -> int:
    from treadle.bench.accuracy import accuracy_table

    print(accuracy_table(args.models, args.workdir, args.text, quantize=not args.no_quantize))
    return 0
