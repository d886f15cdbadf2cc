"""Quantization methods, one per linear layer, chosen at load time by name.

Names (``--quantization``):

    int8                 weight-only int8, one scale per output channel
    int4                 weight-only int4, groups of 32 inputs (same as int4-g32)
    int4-g32|g64|g128    weight-only int4 with that group size
    gguf                 keep a GGUF file's Q4_0/Q4_1/Q8_0 blocks quantized (see gguf_native);
                         built by the GGUF loader from the file's tensor types
    none / None          no quantization

Embeddings and lm_head stay unquantized (GGUF blocks excepted). A method factory maps a layer's name
(``model.layers.3.mlp.gate_up_proj``) to its method, or None for the plain float one.
"""
from __future__ import annotations

from collections.abc import Callable

from treadle.config import TreadleError
from treadle.layers.linear import LinearMethod
from treadle.quantization.weight_only import Int4WeightOnlyMethod, Int8WeightOnlyMethod

MethodFactory = Callable[[str], LinearMethod | None]

WEIGHT_ONLY_NAMES = ("int8", "int4", "int4-g32", "int4-g64", "int4-g128")


def _keep_float(layer_name: str) -> bool:
    return layer_name in ("lm_head", "model.embed_tokens")


def weight_only_factory(name: str) -> MethodFactory:
    """The factory for one of WEIGHT_ONLY_NAMES (the layer-independent methods)."""
    if name == "int8":
        return lambda layer: None if _keep_float(layer) else Int8WeightOnlyMethod()
    if name == "int4":
        name = "int4-g32"
    if name in ("int4-g32", "int4-g64", "int4-g128"):
        group = int(name.removeprefix("int4-g"))
        return lambda layer: None if _keep_float(layer) else Int4WeightOnlyMethod(group)
    raise TreadleError(
        f"quantization {name!r} is not supported (supported: {', '.join(WEIGHT_ONLY_NAMES)}, gguf, none)"
    )
