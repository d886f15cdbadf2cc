"""`treadle train-length-predictor MODEL OUT --prompts FILE`: train an output-length predictor
(``treadle.predict``) by self-distillation: the model's own greedy answers give the lengths.

    prompts (train | heldout) --LLM (greedy, max_tokens)--> true output lengths
            --fit (pairwise ranking + log-length anchor)--> OUT/length_predictor.{json,safetensors}
            --held-out prompts--> Kendall's tau, cost per request; OUT/lengths.jsonl (every prompt's
              true and predicted length: the oracle of ``treadle bench serve --ordering oracle``)

FILE: the prompt-set format (JSON lines with ``text`` and ``split``; default: the shipped
``treadle/assets/length_prompts.jsonl``), or plain text, one prompt a line (every fourth line
held out).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from treadle.config import TreadleError


def register(sub: Any) -> None:
    p = sub.add_parser("train-length-predictor", help="train an output-length predictor for --scheduling-policy "
                       "predicted (self-distillation on the model's greedy answers)")
    p.add_argument("model", metavar="MODEL", help="the model (name or path)")
    p.add_argument("out", type=Path, metavar="OUT", help="directory to write the predictor to")
    p.add_argument("--prompts", type=Path, default=None, metavar="FILE",
                   help="JSON lines (text, split) or plain text, one prompt a line (default: the shipped set)")
    p.add_argument("--chat", choices=("auto", "yes", "no"), default="auto",
                   help="wrap prompts as user chat messages (auto: when the model has a chat template)")
    p.add_argument("--max-tokens", type=int, default=384, help="longest answer generated (lengths are capped here)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="generation batch size")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps (full batch)")
    p.add_argument("--reuse-lengths", action="store_true",
                   help="fit on OUT/lengths.jsonl from an earlier run instead of generating again")
    p.add_argument("--threads", type=int, default=1, help="torch threads (one is fastest on a busy machine)")
    p.add_argument("--num-buckets", type=int, default=1 << 14, help="hashed n-gram feature buckets")
    p.set_defaults(func=run)


def read_prompts(path: Path | None) -> list[tuple[str, str, str]]:
    """(text, split, kind) per prompt."""
    from treadle.predict import prompt_set

    if path is None:
        return [(p.text, p.split, p.kind) for p in prompt_set.load()]
    try:
        lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except OSError as e:
        raise TreadleError(f"--prompts {path}: {e.strerror or e}") from None
    if not lines:
        raise TreadleError(f"--prompts {path}: no prompts")
    if lines[0].startswith("{"):
        try:
            rows = [json.loads(line) for line in lines]
            return [(str(r["text"]), str(r.get("split", "train")), str(r.get("kind", ""))) for r in rows]
        except (ValueError, KeyError, TypeError) as e:
            raise TreadleError(f"--prompts {path}: not JSON lines with 'text' ({e!r})") from None
    return [(t, "heldout" if i % 4 == 3 else "train", "") for i, t in enumerate(lines)]


def generate_lengths(model: str, texts: list[str], chat: str, max_tokens: int,
                     max_num_seqs: int) -> tuple[list[list[int]], list[int], int]:
    """(prompt token ids as the engine sees them, greedy output lengths, vocab size)."""
    from treadle.entrypoints.llm import LLM
    from treadle.sampling_params import SamplingParams

    llm = LLM(model, max_num_seqs=max_num_seqs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    try:
        tok = llm.get_tokenizer()
        use_chat = chat == "yes" or (chat == "auto" and getattr(tok, "chat_template", None) is not None)
        outs = (llm.chat([[{"role": "user", "content": t}] for t in texts], params, use_tqdm=True) if use_chat
                else llm.generate(texts, params, use_tqdm=True))
        vocab = llm.engine.model_config.vocab_size
    finally:
        llm.shutdown()
    return [o.prompt_token_ids for o in outs], [len(o.outputs[0].token_ids) for o in outs], vocab


def write_lengths(out: Path, rows: list[tuple[str, str, str]], ids: list[list[int]], lengths: list[int],
                  predicted: list[int] | None, vocab: int) -> None:
    """OUT/lengths.jsonl: per prompt its text, split, kind, true and predicted length, token ids."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "lengths.jsonl", "w") as f:
        for i, ((text, split, kind), n) in enumerate(zip(rows, lengths)):
            f.write(json.dumps({"text": text, "split": split, "kind": kind, "length": n,
                                "predicted": None if predicted is None else predicted[i],
                                "vocab_size": vocab, "prompt_token_ids": ids[i]}) + "\n")


def reuse_lengths(out: Path, rows: list[tuple[str, str, str]]) -> tuple[list[list[int]], list[int], int]:
    try:
        old = [json.loads(line) for line in (out / "lengths.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        raise TreadleError(f"--reuse-lengths: cannot read {out / 'lengths.jsonl'}: {e}") from None
    if [r["text"] for r in old] != [r[0] for r in rows]:
        raise TreadleError(f"--reuse-lengths: {out / 'lengths.jsonl'} was made from other prompts")
    return [r["prompt_token_ids"] for r in old], [int(r["length"]) for r in old], int(old[0]["vocab_size"])


def run(args: argparse.Namespace) -> int:
    from treadle.predict.model import PredictorConfig
    from treadle.predict.training import FitSettings, fit, kendall_tau

    if args.max_tokens < 1 or args.steps < 1 or args.num_buckets < 16:
        raise TreadleError("--max-tokens and --steps must be at least 1, --num-buckets at least 16")
    import torch

    rows = read_prompts(args.prompts)
    torch.set_num_threads(max(1, args.threads))
    t0 = time.perf_counter()
    if args.reuse_lengths:
        ids, lengths, vocab = reuse_lengths(args.out, rows)
    else:
        ids, lengths, vocab = generate_lengths(args.model, [r[0] for r in rows], args.chat, args.max_tokens,
                                               args.max_num_seqs)
        write_lengths(args.out, rows, ids, lengths, None, vocab)  # kept even if the fit fails
    train = [i for i, r in enumerate(rows) if r[1] == "train"]
    held = [i for i, r in enumerate(rows) if r[1] != "train"]
    if len(train) < 2:
        raise TreadleError("need at least two training prompts")
    config = PredictorConfig(args.num_buckets, (1, 2, 3), Path(args.model.rstrip("/")).name, vocab)
    pred = fit([ids[i] for i in train], [lengths[i] for i in train], config, FitSettings(steps=args.steps))
    t1 = time.perf_counter()
    predicted = pred.predict(ids)
    t_pred = (time.perf_counter() - t1) / len(ids)
    tau_train = kendall_tau([predicted[i] for i in train], [lengths[i] for i in train])
    tau_held = kendall_tau([predicted[i] for i in held], [lengths[i] for i in held]) if len(held) > 1 else None
    training = {"prompts": len(train), "heldout": len(held), "max_tokens": args.max_tokens,
                "kendall_tau_train": round(tau_train, 3),
                "kendall_tau_heldout": None if tau_held is None else round(tau_held, 3),
                "us_per_request": round(t_pred * 1e6, 1)}
    pred = type(pred)(PredictorConfig(config.num_buckets, config.orders, config.model, vocab, training),
                      pred.weights, pred.extra)
    pred.save(args.out)
    write_lengths(args.out, rows, ids, lengths, predicted, vocab)
    print(f"wrote {args.out}: {len(train)} training prompts, held-out Kendall's tau "
          f"{'-' if tau_held is None else f'{tau_held:.3f}'} ({len(held)} prompts; train {tau_train:.3f}), "
          f"{t_pred * 1e6:.0f} us per request to predict, {time.perf_counter() - t0:.0f} s in all")
    return 0
