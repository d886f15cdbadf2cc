"""Published quantized checkpoints: a Hugging Face directory whose config.json has a
``quantization_config`` (compressed-tensors, GPTQ, AWQ) says, per linear module, which tensors
replace its float ``weight`` and how to read them. This module is the common part:

    config.json quantization_config --read_checkpoint_quantization--> CheckpointQuantization
        .method                      "compressed-tensors" | "gptq" | "awq" (what --quantization
                                     auto resolves to)
        .format_for(module)          the module's LayerFormat, or None when it stays float
    LayerFormat
        .tensors(rows, in_features)  suffix -> (shape, dtype) the file must hold for one module
        .method()                    the LinearMethod that loads and runs it

The expected-tensor check, the dtype check (both before any weight is read) and the
per-layer method factory all derive from those two calls (the parsers, one module per
quant_method, are chosen in ``published.py``). The methods run on the CPU (C kernels) or, for
weights on a CUDA device, on Triton kernels (``gpu.py``), chosen once after loading.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

from safetensors import safe_open

from treadle.config import TreadleError
from treadle.layers.linear import LinearMethod

Shape = tuple[int, ...]
FLOAT = "float"  # a tensors() dtype meaning any floating type (F32, F16, BF16)
_FLOAT_DTYPES = ("F32", "F16", "BF16")
CHECKPOINT_METHODS = ("compressed-tensors", "gptq", "awq")


class LayerFormat(ABC):
    """How one linear module's quantized weight is stored in a checkpoint (a frozen dataclass:
    equal formats compare equal, so the shards of a fused layer can be checked alike)."""

    name: str  # the scheme in words, for error messages ("compressed-tensors pack-quantized int4 g128")
    # whether a tensor-parallel rank can take its part of each tensor as of a float weight:
    # [out, in] tensors cut like the weight, [out, 1] per-channel scales cut by rows only
    tensor_parallel = False

    @abstractmethod
    def tensors(self, rows: int, in_features: int) -> dict[str, tuple[Shape, str]]:
        """Tensor suffix (``weight_packed``, ``qweight``...) -> (shape, safetensors dtype name
        such as "I32", or FLOAT) for a module of ``rows`` outputs and ``in_features`` inputs;
        these replace the float ``weight`` (a ``bias`` is kept as it is)."""

    @abstractmethod
    def method(self) -> LinearMethod:
        """A new LinearMethod for one layer stored in this format."""


class CheckpointQuantization(ABC):
    """A checkpoint's quantization_config, parsed."""

    method: str  # one of CHECKPOINT_METHODS

    @abstractmethod
    def format_for(self, module: str) -> LayerFormat | None:
        """The format of checkpoint module ``module`` (``model.layers.0.self_attn.q_proj``),
        None when it is stored in float (ignored modules, lm_head, embeddings)."""

    @abstractmethod
    def formats(self) -> list[LayerFormat]:
        """Every format some module may be stored in."""

    @property
    def tensor_parallel(self) -> bool:
        """Whether the checkpoint can be split across tensor-parallel ranks."""
        return all(f.tensor_parallel for f in self.formats())


def _module_of(weight_name: str) -> str | None:
    return weight_name.removesuffix(".weight") if weight_name.endswith(".weight") else None


def quantized_expected(quant: CheckpointQuantization, float_expected: dict[str, Shape]) -> dict[str, Shape]:
    """The float checkpoint's expected tensors (name -> shape) with each quantized module's
    ``weight`` replaced by its format's tensors."""
    out: dict[str, Shape] = {}
    for name, shape in float_expected.items():
        module = _module_of(name)
        fmt = None if module is None or len(shape) != 2 else quant.format_for(module)
        if fmt is None:
            out[name] = shape
            continue
        out |= {f"{module}.{suffix}": s for suffix, (s, _) in fmt.tensors(shape[0], shape[1]).items()}
    return out


def check_dtypes(quant: CheckpointQuantization, float_expected: dict[str, Shape], files: list[Path]) -> None:
    """Every quantized tensor has the dtype its format needs (read from the headers only);
    a wrong one is a one-line TreadleError naming the file and the tensor."""
    wanted: dict[str, tuple[str, str]] = {}
    for name, shape in float_expected.items():
        module = _module_of(name)
        fmt = None if module is None or len(shape) != 2 else quant.format_for(module)
        if fmt is not None:
            for suffix, (_, dtype) in fmt.tensors(shape[0], shape[1]).items():
                wanted[f"{module}.{suffix}"] = (dtype, fmt.name)
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key not in wanted:
                    continue
                got, (need, scheme) = f.get_slice(key).get_dtype(), wanted[key]
                if got != need and not (need == FLOAT and got in _FLOAT_DTYPES):
                    raise TreadleError(f"{file}: tensor {key!r} has dtype {got}, {scheme} stores it as "
                                       f"{'a float' if need == FLOAT else need}")


def checkpoint_method_factory(
    quant: CheckpointQuantization, shard_names: Callable[[str], list[str]],
) -> Callable[[str], LinearMethod | None]:
    """The per-layer method factory (``shard_names``: the model layout's, a layer name -> its
    checkpoint weight names). The shards of a fused layer must share one format."""

    def method(layer: str) -> LinearMethod | None:
        modules = [m for m in map(_module_of, shard_names(layer)) if m is not None]
        formats = [quant.format_for(m) for m in modules]
        if all(f is None for f in formats):
            return None
        if any(f != formats[0] for f in formats):
            raise TreadleError(f"{layer}: its parts {', '.join(modules)} are quantized differently "
                               "(fused layers need one scheme)")
        assert formats[0] is not None
        return formats[0].method()

    return method
