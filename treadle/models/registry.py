"""Hugging Face architecture name -> model class."""
from __future__ import annotations

from torch import nn

from treadle.config import TreadleError
from treadle.models.llama import LlamaForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(architecture: str) -> type[nn.Module]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise TreadleError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}"
        ) from None
