"""Seeded synthetic workloads. Prompts are token ids, so any model can run them.

- ``fixed``: every prompt has ``input_len`` tokens and asks for ``output_len``.
- ``random``: lengths drawn uniformly from ranges (``--input-len 32:512``).
- ``chat``: a ShareGPT-like shape: log-normal prompt lengths (median 180
  tokens, sigma 0.9, clipped to [8, 1024]) and log-normal output lengths
  (median 120, sigma 0.7, clipped to [8, 512]); both are clipped again so
  prompt + output fits ``max_total_len``. Long-tailed on both sides, as real
  chat traffic is: most turns are short, a few are long documents.
- ``shared-prefix``: every prompt starts with the same ``prefix_len``-token
  "system prompt" (one of ``num_prefixes`` of them), followed by a random
  suffix of ``input_len`` tokens; exercises the prefix cache.
- ``mixed``: long prompts interfering with ongoing decodes (the P/D case): even requests
  have short prompts (``input_len.lo`` tokens) and long outputs (``output_len.hi``), odd
  ones long prompts (``input_len.hi``) and short outputs (``output_len.lo``).
- ``grounded``: input-grounded chat turns: repeat or lightly edit a given passage
  (``passages.py``; needs the model's tokenizer and chat template); the output
  length is the passage's length in tokens (clipped to ``output_len``), so most
  of the answer is in the prompt: what n-gram speculation exploits.
- ``chat-text``: real chat turns (``passages.CHAT_QUESTIONS``, through the chat template;
  needs the tokenizer), ``output_len`` tokens each: what a draft head is for.
- ``lengths``: the held-out prompts of the length-varied prompt set (``treadle/predict/prompt_set.py``:
  "answer in one word" ... "write a long story about"), mixed 70 % short, 20 % medium, 10 % long
  answers, tokenized as when the lengths were measured; each asks for its true length (the model's own greedy answer,
  from a ``lengths.jsonl`` written by ``treadle train-length-predictor``; at most ``output_len``),
  so a run does the same work under every scheduling policy and an oracle can order by it.

Token ids are uniform over ``[low_token, vocab_size)``, skipping the low ids
where most tokenizers keep their special tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from treadle.bench import BenchError
from treadle.bench.passages import CHAT_QUESTIONS, INSTRUCTIONS, PASSAGES

WORKLOADS = ("fixed", "random", "chat", "shared-prefix", "grounded", "mixed", "chat-text", "lengths")
LENGTH_MIX = {"short": 0.7, "medium": 0.2, "long": 0.1}  # the ``lengths`` workload's answer kinds

CHAT_PROMPT = (180.0, 0.9, 8, 1024)  # median, sigma, min, max
CHAT_OUTPUT = (120.0, 0.7, 8, 512)


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    priority: int = 0  # sent as the request's priority when not 0 (``bench serve --ordering``)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class LengthRange:
    lo: int
    hi: int  # inclusive

    @staticmethod
    def parse(text: str | int) -> LengthRange:
        """'128' -> 128..128, '32:512' -> 32..512."""
        lo_s, _, hi_s = str(text).partition(":")
        lo, hi = int(lo_s), int(hi_s or lo_s)
        if lo < 1 or hi < lo:
            raise BenchError(f"length {text!r}: need 1 <= LO <= HI (write N or LO:HI)")
        return LengthRange(lo, hi)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.lo, self.hi + 1, size=n)

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}:{self.hi}"


@dataclass(frozen=True)
class WorkloadSpec:
    kind: str = "random"
    num_prompts: int = 64
    input_len: LengthRange = LengthRange(32, 512)
    output_len: LengthRange = LengthRange(16, 256)
    prefix_len: int = 512  # shared-prefix only
    num_prefixes: int = 1  # shared-prefix only
    seed: int = 0
    lengths_file: str | None = None  # lengths only: the prompts' true lengths (train-length-predictor's)

    def describe(self) -> str:
        if self.kind == "chat":
            return f"chat x{self.num_prompts} (log-normal lengths, seed {self.seed})"
        if self.kind == "shared-prefix":
            return (f"shared-prefix x{self.num_prompts} (prefix {self.prefix_len} x{self.num_prefixes}, "
                    f"suffix {self.input_len}, out {self.output_len}, seed {self.seed})")
        return f"{self.kind} x{self.num_prompts} (in {self.input_len}, out {self.output_len}, seed {self.seed})"


def _token_ids(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    low = min(100, vocab_size // 2)
    return rng.integers(low, vocab_size, size=n).tolist()


def _lognormal(rng: np.random.Generator, n: int, shape: tuple[float, float, int, int]) -> np.ndarray:
    median, sigma, lo, hi = shape
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, size=n)), lo, hi).astype(int)


def grounded_request(spec: WorkloadSpec, tokenizer: Any, passage: str, instruction: str) -> BenchRequest:
    text = instruction.format(passage=passage)
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]),
                              add_special_tokens=False)
    return BenchRequest(prompt, min(len(tokenizer.encode(passage, add_special_tokens=False)) + 8, spec.output_len.hi))


def grounded_workload(spec: WorkloadSpec, tokenizer: Any, token_salt: int = 0) -> list[BenchRequest]:
    """Chat prompts asking to repeat or edit a passage; passage and instruction picked by
    (seed, salt, index), the output length is the passage's token count (at most output_len).
    ``token_salt=-1``: every passage x instruction once (for sizing max_model_len)."""
    if tokenizer is None:
        raise BenchError("the grounded workload needs the model's tokenizer")
    if token_salt == -1:
        return [grounded_request(spec, tokenizer, p, i) for p in PASSAGES for i in INSTRUCTIONS]
    rng = np.random.default_rng([spec.seed, token_salt])
    return [grounded_request(spec, tokenizer, PASSAGES[int(rng.integers(len(PASSAGES)))],
                             INSTRUCTIONS[int(rng.integers(len(INSTRUCTIONS)))]) for _ in range(spec.num_prompts)]


def chat_text_workload(spec: WorkloadSpec, tokenizer: Any, token_salt: int = 0) -> list[BenchRequest]:
    """Chat turns from ``CHAT_QUESTIONS``, picked by (seed, salt, index); ``token_salt=-1``:
    every question once (for sizing max_model_len)."""
    if tokenizer is None:
        raise BenchError("the chat-text workload needs the model's tokenizer")
    rng = np.random.default_rng([spec.seed, max(0, token_salt)])
    picks = (range(len(CHAT_QUESTIONS)) if token_salt == -1
             else [int(rng.integers(len(CHAT_QUESTIONS))) for _ in range(spec.num_prompts)])
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": CHAT_QUESTIONS[i]}]) for i in picks]
    return [BenchRequest(tokenizer.encode(text, add_special_tokens=False), spec.output_len.hi) for text in chat]


def lengths_workload(spec: WorkloadSpec, tokenizer: Any, token_salt: int = 0) -> list[BenchRequest]:
    """Held-out prompts drawn by LENGTH_MIX (without replacement within a kind until it runs
    out), each asking for its true length; ``token_salt`` redraws the picks."""
    import json

    if tokenizer is None or spec.lengths_file is None:
        raise BenchError("the lengths workload needs the model's tokenizer and a lengths file "
                         "(--lengths-file, or a model with a shipped length predictor)")
    try:
        rows = [json.loads(line) for line in open(spec.lengths_file) if line.strip()]
    except (OSError, ValueError) as e:
        raise BenchError(f"cannot read the lengths file {spec.lengths_file}: {e}") from None
    by_kind = {k: [r for r in rows if r.get("split") == "heldout" and r.get("kind") == k] for k in LENGTH_MIX}
    if not all(by_kind.values()):
        raise BenchError(f"{spec.lengths_file} lacks held-out prompts of some kind ({', '.join(LENGTH_MIX)})")
    rng = np.random.default_rng([spec.seed, max(0, token_salt)])
    kinds = rng.choice(list(LENGTH_MIX), size=spec.num_prompts, p=list(LENGTH_MIX.values()))
    decks = {k: [int(i) for i in rng.permutation(len(v))] for k, v in by_kind.items()}
    taken = dict.fromkeys(LENGTH_MIX, 0)
    reqs = []
    for kind in kinds.tolist():
        row = by_kind[kind][decks[kind][taken[kind] % len(decks[kind])]]
        taken[kind] += 1
        ids = row.get("prompt_token_ids")  # as the model saw it when its length was measured
        if ids is None:
            text = tokenizer.apply_chat_template([{"role": "user", "content": row["text"]}])
            ids = tokenizer.encode(text, add_special_tokens=False)
        reqs.append(BenchRequest(list(ids), max(1, min(int(row["length"]), spec.output_len.hi))))
    return reqs


def make_workload(
    spec: WorkloadSpec, vocab_size: int, max_total_len: int | None = None, token_salt: int = 0,
    tokenizer: Any = None,
) -> list[BenchRequest]:
    """The requests of a workload; the same arguments give the same list. The
    lengths depend on ``spec.seed`` only; ``token_salt`` redraws the token ids,
    so repeated runs do not hit a prefix cache filled by the previous run
    (``grounded`` prompts are text: the salt picks other passages / instructions)."""
    if spec.kind not in WORKLOADS:
        raise BenchError(f"unknown workload {spec.kind!r}; choose one of {', '.join(WORKLOADS)}")
    if spec.kind == "grounded":
        return grounded_workload(spec, tokenizer, token_salt)
    if spec.kind == "chat-text":
        return chat_text_workload(spec, tokenizer, token_salt)
    if spec.kind == "lengths":
        return lengths_workload(spec, tokenizer, token_salt)
    rng = np.random.default_rng(spec.seed)
    tok_rng = np.random.default_rng([spec.seed, token_salt])
    n = spec.num_prompts
    if spec.kind == "fixed":
        ins, outs = np.full(n, spec.input_len.hi), np.full(n, spec.output_len.hi)
    elif spec.kind == "chat":
        ins, outs = _lognormal(rng, n, CHAT_PROMPT), _lognormal(rng, n, CHAT_OUTPUT)
    elif spec.kind == "mixed":
        long_prompt = np.arange(n) % 2 == 1
        ins = np.where(long_prompt, spec.input_len.hi, spec.input_len.lo)
        outs = np.where(long_prompt, spec.output_len.lo, spec.output_len.hi)
    else:
        ins, outs = spec.input_len.sample(rng, n), spec.output_len.sample(rng, n)
    prefixes = [_token_ids(tok_rng, spec.prefix_len, vocab_size) for _ in range(spec.num_prefixes)]
    reqs = []
    for i, (n_in, n_out) in enumerate(zip(ins.tolist(), outs.tolist())):
        head = prefixes[i % spec.num_prefixes] if spec.kind == "shared-prefix" else []
        if max_total_len is not None:
            n_out = min(n_out, max_total_len - len(head) - 1)
            n_in = min(n_in, max_total_len - len(head) - n_out)
            if n_out < 1 or n_in < 1:
                raise BenchError(f"max_model_len {max_total_len} is too short for this workload")
        reqs.append(BenchRequest(head + _token_ids(tok_rng, n_in, vocab_size), n_out))
    return reqs


def max_total_len(reqs: list[BenchRequest]) -> int:
    return max(r.prompt_len + r.output_len for r in reqs)
