"""Engine flags shared by `generate`, `chat`, `serve` and `bench` (named like vLLM's)."""
from __future__ import annotations

import argparse
from typing import Any

DEFAULT_MODEL = "smollm2-135m-instruct"


def add_engine_args(p: argparse.ArgumentParser, model_positional: bool = False) -> None:
    if model_positional:
        p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL", help="model name or path")
    p.add_argument("--model", default=None, help=f"short name or path (default {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-memory", default=None, help="KV cache size, e.g. 2GiB (default: a share of free memory)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "reference", "cpu", "triton"])
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (decode runs eagerly)")
    p.add_argument(
        "--quantization", default=None,
        help="auto (default: a GGUF file keeps its Q4_0/Q4_1/Q8_0 blocks on the CPU), none, gguf, int8, int4[-g32|-g64|-g128]",
    )
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    model = getattr(args, "model_pos", None) or args.model or DEFAULT_MODEL
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    kw: dict[str, Any] = dict(
        model=model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory, block_size=args.block_size,
        enable_chunked_prefill=args.enable_chunked_prefill, attention_backend=args.attention_backend,
        seed=args.seed, enforce_eager=args.enforce_eager,
    )
    if args.quantization:
        kw["quantization"] = args.quantization
    return kw


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default 0 for generate)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")


def sampling_kwargs(args: argparse.Namespace, default_temperature: float) -> dict[str, Any]:
    return dict(
        max_tokens=args.max_tokens,
        temperature=default_temperature if args.temperature is None else args.temperature,
        top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, stop=args.stop, ignore_eos=args.ignore_eos,
        seed=args.sampling_seed,
    )
