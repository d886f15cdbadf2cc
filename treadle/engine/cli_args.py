"""Engine flags shared by `generate`, `chat`, `serve`, `bench` and `doctor`, made from
``EngineArgs``' fields (names, defaults, help), so the CLI holds no second copy of any default.
It lives beside ``EngineArgs`` so that every verb, in entrypoints/ or in the package that owns
it (bench/), stands on it from above."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from treadle.engine.args import EngineArgs

DEFAULT_MODEL = EngineArgs.model


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (else argparse's one-line usage error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is less than 1")
    return value


def add_engine_args(p: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """One flag per EngineArgs field (``--max-model-len`` for ``max_model_len``; booleans get
    ``--x`` / ``--no-x``), plus ``--threads``."""
    if model_positional:
        p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL", help="model name or path")
    for f in dataclasses.fields(EngineArgs):
        meta = dict(f.metadata)
        flags = meta.pop("flags", (f"--{f.name.replace('_', '-')}",))
        shown = "" if f.default is None else f" (default: {f.default})"
        kw: dict[str, Any] = dict(dest=f.name, help=meta.pop("help") + shown)
        if f.name == "model":
            kw["default"] = None  # a positional MODEL may still come; engine_kwargs falls back
        elif isinstance(f.default, bool):
            kw.update(default=f.default, action=argparse.BooleanOptionalAction)
        else:
            kw.update(default=f.default, type=meta.pop("type", type(f.default)), choices=meta.pop("choices", None))
        p.add_argument(*flags, **kw)
    p.add_argument("--threads", type=positive_int, default=None, help="CPU threads (default: all cores; serve's engine process: all but one)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineArgs fields from parsed flags (``model`` from the positional MODEL or
    --model); applies --threads to this process."""
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs)}
    kw["model"] = getattr(args, "model_pos", None) or args.model or DEFAULT_MODEL
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
