"""Pick the attention backend at start-up, from its name and the device.

``auto`` resolves by device: Triton on CUDA when triton is importable (else the
reference backend), the CPU backend on the CPU. Fast backends are imported lazily,
so the engine imports without triton.
"""
from __future__ import annotations

import importlib.util

import torch

from treadle import envs
from treadle.config import TreadleError
from treadle.layers.attention.backend import AttentionBackend
from treadle.layers.attention.reference import ReferenceBackend

BACKEND_NAMES = ("auto", "reference", "cpu", "triton")


def resolve_backend_name(name: str, device: torch.device | str) -> str:
    """The concrete backend ``name`` stands for on ``device`` (pure: no construction)."""
    if name not in BACKEND_NAMES:
        raise TreadleError(f"unknown attention backend {name!r}; choose one of: {', '.join(BACKEND_NAMES)}")
    if name != "auto":
        return name
    if torch.device(device).type == "cuda":
        return "triton" if importlib.util.find_spec("triton") is not None else "reference"
    return "cpu"


def select_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """Build the attention backend ``name`` ("auto", "reference", "cpu", "triton") for ``device``."""
    resolved = resolve_backend_name(name, device)
    if resolved == "reference":
        return ReferenceBackend()
    if resolved == "cpu":
        from treadle.layers.attention.cpu import CPUBackend

        return CPUBackend()
    if torch.device(device).type != "cuda" and not envs.triton_interpret():
        raise TreadleError("the triton attention backend needs a CUDA device (or TRITON_INTERPRET=1 for testing)")
    from treadle.layers.attention.triton_backend import TritonBackend

    return TritonBackend()
