"""The tensors a checkpoint must hold, by Hugging Face name and shape, from its
architecture's layout (``treadle.models.layout``).

Checked against a file's header before any weight is read, so a missing, extra or
misshapen tensor is one clear error naming the file, not a traceback mid-load or a
model silently running on uninitialised memory.
"""
from __future__ import annotations

from pathlib import Path

from treadle.config import ModelConfig, TreadleError
from treadle.models.registry import model_layout

Shape = tuple[int, ...]


def expected_tensors(cfg: ModelConfig) -> dict[str, Shape]:
    return model_layout(cfg.architecture).expected_tensors(cfg)


def is_ignored(name: str, cfg: ModelConfig) -> bool:
    """Tensors a checkpoint may carry that the model does not use (never read)."""
    return model_layout(cfg.architecture).is_ignored(name, cfg)


def check_tensors(path: Path, found: dict[str, Shape], cfg: ModelConfig,
                  expected: dict[str, Shape] | None = None) -> None:
    """Raise TreadleError unless ``found`` (name -> shape) is exactly what the model needs
    (``expected``: instead of the float checkpoint's tensors, e.g. a quantized checkpoint's)."""
    expected = expected_tensors(cfg) if expected is None else expected
    for name, shape in found.items():
        if is_ignored(name, cfg):
            continue
        if name not in expected:
            raise TreadleError(f"{path}: unexpected tensor {name!r} for {cfg.architecture}")
        if tuple(shape) != expected[name]:
            raise TreadleError(f"{path}: tensor {name!r} has shape {tuple(shape)}, the config implies {expected[name]}")
    missing = [name for name in expected if name not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise TreadleError(f"{path}: tensor {missing[0]!r} is missing{more}")
