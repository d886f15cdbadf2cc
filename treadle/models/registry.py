"""Hugging Face architecture name -> model class (each class carries its ``layout``)."""
from __future__ import annotations

from treadle.config import TreadleError
from treadle.models.gemma3 import Gemma3ForCausalLM
from treadle.models.layout import ModelLayout
from treadle.models.llama import LlamaForCausalLM
from treadle.models.mixtral import MixtralForCausalLM
from treadle.models.phi3 import Phi3ForCausalLM
from treadle.models.qwen3 import Qwen3ForCausalLM
from treadle.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

_MODELS: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise TreadleError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}"
        ) from None


def model_layout(architecture: str) -> ModelLayout:
    """The parameter table of ``architecture`` (see treadle.models.layout)."""
    return model_class(architecture).layout
