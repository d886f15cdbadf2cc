"""Quantization methods, one per linear layer, chosen at load time by name.

Names (``--quantization``):

    int8                 weight-only 8-bit: Q8_0 blocks (a float16 scale per 32 inputs) on
                         Treadle's C kernels, as a GGUF file would hold them
    int4                 weight-only 4-bit, groups of 32 inputs (same as int4-g32): Q4_1 blocks
                         (float16 scale and minimum per 32) on the C kernels
    int4-g64|g128        weight-only int4 with that group size on torch's packed int4 kernel
    (int8 and int4-g32 fall back to torch's kernels -- int8 then with one scale per output
    channel -- for a layer whose input width is not a multiple of 32, or without the C kernels)
    gguf                 keep a GGUF file's blocks quantized (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and the
                         K-quants Q2_K..Q6_K; see gguf_native); built by the GGUF loader from
                         the file's tensor types
    none / None          no quantization
    compressed-tensors, gptq, awq
                         a published quantized checkpoint (config.json ``quantization_config``),
                         read as it is stored: see checkpoint.py; "auto" picks it, any other
                         value for such a checkpoint is an error

Embeddings and lm_head stay unquantized (GGUF blocks excepted). A method factory maps a layer's name
(``model.layers.3.mlp.gate_up_proj``) to its method, or None for the plain float one.
"""
from __future__ import annotations

from collections.abc import Callable

from treadle.config import TreadleError
from treadle.kernels import native
from treadle.layers.linear import LinearMethod
from treadle.quantization.formats.checkpoint import CHECKPOINT_METHODS
from treadle.quantization.methods.gguf_native import GGUFBlockMethod
from treadle.quantization.methods.weight_only import Int4WeightOnlyMethod, Int8WeightOnlyMethod

MethodFactory = Callable[[str], LinearMethod | None]

WEIGHT_ONLY_NAMES = ("int8", "int4", "int4-g32", "int4-g64", "int4-g128")


def resolve_quantization(name: str | None, gguf_file: bool, on_cpu: bool, checkpoint: str | None = None) -> str:
    """The concrete method a ``--quantization`` value stands for: "auto" is ``checkpoint`` (the
    method of a quantized checkpoint's quantization_config), else "gguf" for a .gguf file on
    the CPU, else "none"; "int4" is "int4-g32". Unknown names and impossible choices are
    one-line TreadleErrors."""
    if checkpoint is not None:  # read as stored: None (load_model's default) means the same
        if name not in (None, "auto", checkpoint):
            raise TreadleError(f"quantization {name!r} conflicts with the checkpoint's quantization_config "
                               f"({checkpoint}); use --quantization auto")
        return checkpoint  # on a GPU too: Triton kernels (gpu.py)
    name = "none" if name is None else name
    if name in CHECKPOINT_METHODS:
        raise TreadleError(f"quantization {name!r} needs a checkpoint whose config.json has that quantization_config")
    if name == "auto":
        return "gguf" if gguf_file and on_cpu else "none"
    if name == "gguf":
        if not gguf_file:
            raise TreadleError("quantization 'gguf' needs a .gguf file")
        if not on_cpu:
            raise TreadleError("quantization 'gguf' runs on the CPU only; use --quantization none on a GPU")
        return name
    if name == "int4":
        return "int4-g32"
    if name != "none" and name not in WEIGHT_ONLY_NAMES:
        raise TreadleError(
            f"quantization {name!r} is not supported (supported: auto, none, gguf, {', '.join(WEIGHT_ONLY_NAMES)}, "
            f"{', '.join(CHECKPOINT_METHODS)})"
        )
    return name


def tensor_parallel_error(checkpoint: str) -> TreadleError:
    """Why a published quantized checkpoint cannot run split across tensor-parallel ranks."""
    return TreadleError(f"{checkpoint} int4 checkpoints are not supported with tensor parallelism yet (their "
                        "packed tensors are not split across ranks; W8A8 ones are); use tensor_parallel_size 1")


def _keep_float(layer_name: str) -> bool:
    return layer_name in ("lm_head", "model.embed_tokens")


def weight_only_factory(name: str, in_features: Callable[[str], int],
                        full_in_features: Callable[[str], int] | None = None) -> MethodFactory:
    """The factory for one of WEIGHT_ONLY_NAMES; ``in_features`` gives a layer's input width
    from its name (the model layout's ``in_features``, bound to this rank's config), and
    ``full_in_features`` the whole model's (tensor parallelism): a layer quantizes to the same
    blocks on every rank count, so a split that would cut its blocks is refused."""
    if name == "int4":
        name = "int4-g32"
    if name not in WEIGHT_ONLY_NAMES:
        raise TreadleError(
            f"quantization {name!r} is not supported (supported: {', '.join(WEIGHT_ONLY_NAMES)}, gguf, none)"
        )
    blocks = {"int8": "Q8_0", "int4-g32": "Q4_1"}.get(name)

    def method(layer: str) -> LinearMethod | None:
        if _keep_float(layer):
            return None
        if blocks is not None and native.available() and in_features(layer) % 32 == 0:
            return GGUFBlockMethod(blocks)
        if blocks is not None and native.available() and full_in_features is not None \
                and full_in_features(layer) % 32 == 0:
            raise TreadleError(f"{name}: {layer}'s {full_in_features(layer)} inputs split across tensor-parallel "
                               f"ranks leave {in_features(layer)} per rank, which cuts its blocks of 32; "
                               "choose another tensor_parallel_size")
        return Int8WeightOnlyMethod() if name == "int8" else Int4WeightOnlyMethod(int(name.removeprefix("int4-g")))

    return method

