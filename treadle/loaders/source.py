"""What a loader hands over: a checkpoint opened but not yet read (``ModelSource``)."""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from treadle.config import ModelConfig, TreadleError

if TYPE_CHECKING:
    from treadle.quantization.formats.checkpoint import CheckpointQuantization
    from treadle.structured.compiler import GrammarCompiler
    from treadle.tokenizer import Tokenizer


@dataclass
class ModelSource:
    path: Path
    config: ModelConfig
    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]]  # HF-named tensors, streamed
    tokenizer: Tokenizer | None  # None: opened with skip_tokenizer_init (token ids only)
    # GGUF only: HF weight name -> (GGUF type name, HF shape), and a stream that hands the
    # tensors ``keep_raw`` names over still quantized (GGUFBlocks), the rest as floats
    tensor_types: dict[str, tuple[str, tuple[int, ...]]] | None = None
    raw_weights: Callable[[Callable[[str], bool]], Iterator[tuple[str, Any]]] | None = None
    # safetensors only: the same stream of tensors not read yet (``narrow`` reads a part,
    # ``read`` the whole), for a tensor-parallel rank that needs only its part of each
    sliced_weights: Callable[[], Iterator[tuple[str, Any]]] | None = None
    # a published quantized checkpoint (config.json quantization_config): its parsed form
    checkpoint_quantization: CheckpointQuantization | None = None

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """The structured-output grammar compiler for this vocabulary, built on first use
        (the engine and an in-process worker share it, and so its cache)."""
        from treadle.structured.compiler import GrammarCompiler

        if self.tokenizer is None:
            raise TreadleError("structured output needs a tokenizer (the engine runs with skip_tokenizer_init)")
        return GrammarCompiler(self.tokenizer, self.config.vocab_size, self.config.stop_token_ids)
