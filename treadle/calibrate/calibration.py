"""Calibration windows: ``num_samples`` runs of ``seq_len`` tokens cut from a text file."""
from __future__ import annotations

from pathlib import Path

import torch

from treadle.config import TreadleError
from treadle.tokenizer import Tokenizer


def calibration_batch(path: Path, tokenizer: Tokenizer | None, num_samples: int, seq_len: int,
                      seed: int = 0) -> torch.Tensor:  # [num_samples, seq_len] token ids
    """Windows start at evenly spread offsets of the tokenized text (a fixed shuffle when
    there are more windows than fit side by side), so the result is deterministic."""
    if tokenizer is None:
        raise TreadleError("calibration needs the model's tokenizer")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise TreadleError(f"{path}: cannot read the calibration text ({e.strerror})") from None
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < seq_len:
        raise TreadleError(f"{path}: {len(ids)} tokens, fewer than --seq-len {seq_len}")
    tokens = torch.tensor(ids, dtype=torch.long)
    last = len(ids) - seq_len
    if num_samples * seq_len <= len(ids):
        starts = torch.linspace(0, last, num_samples).long()
    else:
        starts = torch.randint(0, last + 1, (num_samples,), generator=torch.Generator().manual_seed(seed))
    return torch.stack([tokens[s:s + seq_len] for s in starts.tolist()])
