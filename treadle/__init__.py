"""Treadle: an LLM inference and serving engine in Python on PyTorch.

``from treadle import LLM, SamplingParams`` — imported lazily so that the
torch-free layers (scheduler, block manager) stay cheap to import.
"""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "AsyncLLM", "EngineArgs", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutputsParams",
           "__version__"]

_LAZY = {
    "LLM": "treadle.entrypoints.llm",
    "AsyncLLM": "treadle.engine.client.in_process",
    "EngineArgs": "treadle.engine.args",
    "SamplingParams": "treadle.sampling_params",
    "StructuredOutputsParams": "treadle.sampling_params",
    "RequestOutput": "treadle.engine.outputs",
    "CompletionOutput": "treadle.engine.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'treadle' has no attribute {name!r}")
