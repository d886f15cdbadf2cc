"""`treadle train-draft-head TARGET OUT --method eagle|medusa --prompts FILE`: train a draft
head by self-distillation on the target's own greedy continuations of the prompts (one per
line), then write OUT in the draft-head format (``treadle.spec_decode.head_format``).

    prompts --LLM.generate (greedy)--> sequences --target forward--> hidden states, labels
            --train_head (CPU, AdamW)--> OUT/config.json + OUT/model.safetensors
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from treadle.config import TreadleError


def register(sub: Any) -> None:
    p = sub.add_parser("train-draft-head", help="train an EAGLE or Medusa draft head for a model (self-distillation)",
                       description="Generate the target's greedy continuations of the prompts, then train a "
                       "draft head on its hidden states; OUT can be passed as speculative_config's \"model\".")
    p.add_argument("target", metavar="TARGET", help="the target model (name or path)")
    p.add_argument("out", type=Path, metavar="OUT", help="directory to write the head to")
    p.add_argument("--method", choices=("eagle", "medusa"), required=True)
    p.add_argument("--prompts", type=Path, required=True, metavar="FILE", help="text file, one prompt per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    p.add_argument("--max-new-tokens", type=int, default=128, help="greedy continuation length per prompt")
    p.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K",
                   help="medusa: number of heads; eagle: the chain length recorded as the default K")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--batch-tokens", type=int, default=2048, help="tokens per optimizer step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=64, help="generation batch size")
    p.add_argument("--threads", type=int, default=1, help="torch threads for training (one is fastest on a busy machine)")
    p.set_defaults(func=run)


def _read_prompts(path: Path) -> list[str]:
    try:
        lines = [line.strip() for line in path.read_text().splitlines()]
    except OSError as e:
        raise TreadleError(f"--prompts {path}: {e.strerror or e}") from None
    prompts = [line for line in lines if line]
    if not prompts:
        raise TreadleError(f"--prompts {path}: no prompts (one per line)")
    return prompts


def generate_sequences(target: str, prompts: list[str], chat: bool, max_new_tokens: int,
                       max_num_seqs: int) -> list[list[int]]:
    """prompt + greedy continuation token ids, per prompt."""
    from treadle.entrypoints.llm import LLM
    from treadle.sampling_params import SamplingParams

    llm = LLM(target, max_num_seqs=max_num_seqs)
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    try:
        outs = (llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=True) if chat
                else llm.generate(prompts, params, use_tqdm=True))
    finally:
        llm.shutdown()
    return [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from treadle.layers.attention.selector import select_backend
    from treadle.loaders import load_model
    from treadle.spec_decode.head_format import EagleLayerShape, HeadConfig, TargetFingerprint, save_head
    from treadle.spec_decode.head_training import FrozenTarget, TrainSettings, collect_hidden, train_head

    for name, value in (("--steps", args.steps), ("--max-new-tokens", args.max_new_tokens),
                        ("--num-speculative-tokens", args.num_speculative_tokens), ("--batch-tokens", args.batch_tokens)):
        if value < 1:
            raise TreadleError(f"{name} must be at least 1")
    prompts = _read_prompts(args.prompts)
    torch.set_num_threads(max(1, args.threads))
    t0 = time.perf_counter()
    seqs = generate_sequences(args.target, prompts, args.chat, args.max_new_tokens, args.max_num_seqs)
    lm = load_model(args.target, select_backend("cpu", torch.device("cpu")), quantization="auto")
    hiddens, labels = collect_hidden(lm.model, seqs)
    settings = TrainSettings(args.method, args.num_speculative_tokens, args.steps, args.batch_tokens, args.lr,
                             seed=args.seed)
    bar = tqdm(total=args.steps, desc=f"train {args.method}", unit="step")
    last: list[float] = [0.0, 0.0]

    def progress(step: int, loss: float, acc: float) -> None:
        last[:] = [loss, acc]
        bar.set_postfix(loss=f"{loss:.3f}", acc=f"{acc:.3f}", refresh=False)
        bar.update(1)

    with torch.enable_grad():
        tensors = train_head(lm.config, FrozenTarget.of(lm.model), seqs, hiddens, labels, settings, progress)
    bar.close()
    layer = EagleLayerShape.like(lm.config) if args.method == "eagle" else None
    config = HeadConfig(args.method, args.num_speculative_tokens,
                        TargetFingerprint.of(lm.config, Path(args.target).name), layer)
    save_head(args.out, config, tensors)
    tokens = sum(map(len, seqs))
    print(f"wrote {args.out}: {args.method} head, {len(seqs)} sequences ({tokens} tokens), "
          f"final loss {last[0]:.3f}, first-draft accuracy {last[1]:.3f}, {time.perf_counter() - t0:.0f} s")
    return 0
