"""The length predictor: hashed token n-grams of the prompt -> a linear score -> log length.

    prompt token ids --n-grams (orders 1..3)--> bucket ids (hash mod num_buckets), each once
                     --sum of weights[bucket] / sqrt(#buckets) + w_len * log1p(len) / 8 + bias--> log(1 + length)

A linear model over hashed n-gram presence: an instruction like "in one word" or "write a
long story" is a handful of n-grams with large weights; cost is one dictionary-free pass over
the prompt (a few microseconds per hundred tokens) and a gather-sum over numpy arrays.

On-disk format (a directory, ``FORMAT`` 1):

- ``length_predictor.json``: ``format`` (1), ``num_buckets``, ``orders`` (n-gram orders),
  ``model`` (the target it was trained for), ``vocab_size``, and ``training`` (what it was
  trained on and its held-out Kendall's tau; informative only);
- ``length_predictor.safetensors``: ``weights`` float32 [num_buckets], ``extra`` float32 [2]
  (the weight of log1p(prompt length) / 8, the bias).

The hash of an n-gram (t1..tn), in unsigned 64-bit arithmetic (wrapping): h = n * 0x9E3779B97F4A7C15;
h = (h xor (t + 1)) * 0x100000001B3 for each t; then h ^= h >> 33; h *= 0xFF51AFD7ED558CCD;
h ^= h >> 33; bucket = h mod num_buckets — the same on every platform.
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from treadle.config import TreadleError

FORMAT = 1
CONFIG_NAME = "length_predictor.json"
WEIGHTS_NAME = "length_predictor.safetensors"
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_FNV_PRIME = np.uint64(0x100000001B3)
_MIX = np.uint64(0xFF51AFD7ED558CCD)
MAX_PREDICTION = 1 << 20
LOG_LEN_SCALE = 8.0  # the prompt-length feature is log1p(length) / 8, about the scale of the others


def bucket_ids(token_ids: Sequence[int], num_buckets: int, orders: Sequence[int]) -> np.ndarray:
    """The distinct buckets of the prompt's n-grams (each counted once), vectorized over positions."""
    ids = np.asarray(token_ids, dtype=np.uint64) + np.uint64(1)
    parts = []
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps mod 2^64, by design
        for n in orders:
            if len(ids) < n:
                continue
            h = np.full(len(ids) - n + 1, np.uint64(n) * _GOLDEN, dtype=np.uint64)
            for j in range(n):
                h = (h ^ ids[j:len(ids) - n + 1 + j]) * _FNV_PRIME
            h = (h ^ (h >> np.uint64(33))) * _MIX  # murmur3's finalizer: every input bit reaches the low bits
            h = h ^ (h >> np.uint64(33))
            parts.append(h % np.uint64(num_buckets))
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return np.unique(np.concatenate(parts)).astype(np.int64)


@dataclass(frozen=True)
class PredictorConfig:
    num_buckets: int = 1 << 14
    orders: tuple[int, ...] = (1, 2, 3)
    model: str = ""
    vocab_size: int = 0
    training: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "num_buckets": self.num_buckets, "orders": list(self.orders),
                "model": self.model, "vocab_size": self.vocab_size, "training": self.training}


class LengthPredictor:
    """Expected output tokens of prompts; ``weights`` [num_buckets], ``extra`` [2]."""

    def __init__(self, config: PredictorConfig, weights: np.ndarray, extra: np.ndarray) -> None:
        if weights.shape != (config.num_buckets,) or extra.shape != (2,):
            raise TreadleError(f"length predictor weights have shapes {weights.shape}, {extra.shape}; expected "
                               f"({config.num_buckets},) and (2,)")
        self.config = config
        self.weights = weights.astype(np.float32)
        self.extra = extra.astype(np.float32)

    def features(self, token_ids: Sequence[int]) -> np.ndarray:
        return bucket_ids(token_ids, self.config.num_buckets, self.config.orders)

    def score(self, token_ids: Sequence[int]) -> float:
        """Predicted log(1 + output tokens); the ranking is by this score."""
        b = self.features(token_ids)
        bag = float(self.weights[b].sum()) / math.sqrt(len(b)) if len(b) else 0.0  # a unit-norm feature vector
        return bag + float(self.extra[0]) * math.log1p(len(token_ids)) / LOG_LEN_SCALE + float(self.extra[1])

    def predict(self, prompts: Sequence[Sequence[int]]) -> list[int]:
        """Expected output tokens per prompt (at least 1)."""
        out = []
        for p in prompts:
            s = self.score(p)
            out.append(max(1, min(MAX_PREDICTION, round(math.expm1(min(s, 20.0))))) if math.isfinite(s) else 1)
        return out

    def save(self, out: Path) -> None:
        from safetensors.numpy import save_file

        out.mkdir(parents=True, exist_ok=True)
        save_file({"weights": self.weights, "extra": self.extra}, str(out / WEIGHTS_NAME))
        (out / CONFIG_NAME).write_text(json.dumps(self.config.to_json(), indent=1) + "\n")

    @staticmethod
    def load(path: Path | str) -> LengthPredictor:
        """Read a predictor directory; a missing or malformed one is one clear TreadleError."""
        from safetensors.numpy import load_file

        path = Path(path)
        try:
            raw = json.loads((path / CONFIG_NAME).read_text())
            tensors = load_file(str(path / WEIGHTS_NAME))
        except (OSError, ValueError) as e:
            raise TreadleError(f"cannot read the length predictor in {path}: {e}") from None
        if raw.get("format") != FORMAT:
            raise TreadleError(f"{path / CONFIG_NAME}: format {raw.get('format')!r}, this Treadle reads {FORMAT}")
        try:
            config = PredictorConfig(int(raw["num_buckets"]), tuple(int(n) for n in raw["orders"]),
                                     str(raw.get("model", "")), int(raw.get("vocab_size", 0)),
                                     dict(raw.get("training", {})))
            return LengthPredictor(config, tensors["weights"], tensors["extra"])
        except (KeyError, TypeError, ValueError) as e:
            raise TreadleError(f"{path / CONFIG_NAME} is malformed: {e!r}") from None


SHIPPED = Path(__file__).resolve().parents[1] / "assets" / "length_predictors"


def shipped_for(model: str) -> Path | None:
    """The predictor shipped for a short model name (``stories260k``, ``smollm2-135m-instruct``),
    or for a path whose last part is one; None when there is none."""
    name = Path(model.rstrip("/")).name.lower()
    path = SHIPPED / name
    return path if (path / CONFIG_NAME).exists() else None


def resolve_predictor(setting: str, model: str) -> LengthPredictor | None:
    """``length_predictor`` -> the predictor: ``none``: None; ``auto``: the shipped one for the
    model if any; else a directory (an unreadable one is a TreadleError)."""
    if setting == "none":
        return None
    if setting == "auto":
        path = shipped_for(model)
        return None if path is None else LengthPredictor.load(path)
    return LengthPredictor.load(setting)
