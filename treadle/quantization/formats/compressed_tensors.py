"""compressed-tensors checkpoints (what llm-compressor writes): the ``quantization_config``
is parsed by the compressed-tensors library itself (``QuantizationConfig``), and the packed
int4 weights are unpacked with its own ``unpack_from_int32``, so the layout is the library's,
not a guess. Supported (per config group; ``ignore`` and ``targets`` matched with the library's
``match_name``; the class target ``Linear`` means every linear module):

    int-quantized   W8A8: int8 ``weight`` [N, K], ``weight_scale`` [N, 1] (symmetric, per
                    output channel); input activations dynamic, per token, symmetric int8
                    -> W8A8Method (treadle/quantization/methods/w8a8.py)
    pack-quantized  W4A16: ``weight_packed`` int32 [N, ceil(K / 8)] (8 values per word, value
                    + 8 stored, low bits first), ``weight_scale`` [N, K / G] (or [N, 1] per
                    channel), ``weight_shape`` int64 [2], asymmetric also ``weight_zero_point``
                    int32 [ceil(N / 8), K / G] packed along the output rows; actorder "group"
                    adds ``weight_g_idx`` [K]. w = (q - zero) * scale, q and zero in -8..7
                    -> Int4CheckpointMethod (int4_checkpoint.py)

Anything else (fp8, static activation scales, other bit widths, float formats) is a one-line
error naming the scheme.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from treadle.config import TreadleError
from treadle.layers.linear import LinearMethod
from treadle.quantization.formats.checkpoint import FLOAT, CheckpointQuantization, LayerFormat, Shape
from treadle.quantization.formats.int4 import Int4Format, Int4Weight


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class PackQuantizedInt4(Int4Format):
    group_size: int | None  # None: one group per output channel
    symmetric: bool
    g_idx: bool  # actorder "group": the checkpoint holds weight_g_idx

    @property
    def name(self) -> str:  # type: ignore[override]
        g = f"g{self.group_size}" if self.group_size else "per-channel"
        return f"compressed-tensors pack-quantized int4 {g} {'symmetric' if self.symmetric else 'asymmetric'}"

    def groups(self, in_features: int) -> int:
        if self.group_size is None:
            return 1
        if in_features % self.group_size:
            raise TreadleError(f"{self.name}: in_features {in_features} is not a multiple of the group size")
        return in_features // self.group_size

    def tensors(self, rows: int, in_features: int) -> dict[str, tuple[Shape, str]]:
        g = self.groups(in_features)
        out = {"weight_packed": ((rows, _ceil(in_features, 8)), "I32"), "weight_scale": ((rows, g), FLOAT),
               "weight_shape": ((2,), "I64")}
        if not self.symmetric:
            out["weight_zero_point"] = ((_ceil(rows, 8), g), "I32")
        if self.g_idx:
            out["weight_g_idx"] = ((in_features,), "I32")
        return out

    def decode(self, tensors: dict[str, torch.Tensor], rows: int, in_features: int) -> Int4Weight:
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        shape = tuple(int(v) for v in tensors["weight_shape"].tolist())
        if shape != (rows, in_features):
            raise TreadleError(f"{self.name}: weight_shape says {shape}, the layer is {(rows, in_features)}")
        q = unpack_from_int32(tensors["weight_packed"], 4, torch.Size(shape))  # int8 -8..7
        g = self.groups(in_features)
        if self.symmetric:
            zero = torch.zeros(rows, g)
        else:
            zero = unpack_from_int32(tensors["weight_zero_point"], 4, torch.Size((rows, g)), packed_dim=0).float()
        group = (tensors["weight_g_idx"].long() if self.g_idx
                 else torch.arange(in_features) // (self.group_size or in_features))
        return Int4Weight((q.to(torch.int16) + 8).to(torch.uint8), tensors["weight_scale"].float(), zero + 8, group)


@dataclass(frozen=True)
class IntQuantizedW8A8(LayerFormat):
    name = "compressed-tensors int-quantized W8A8 (int8 per-channel weights, dynamic per-token int8 activations)"
    tensor_parallel = True

    def tensors(self, rows: int, in_features: int) -> dict[str, tuple[Shape, str]]:
        return {"weight": ((rows, in_features), "I8"), "weight_scale": ((rows, 1), FLOAT)}

    def method(self) -> LinearMethod:
        from treadle.quantization.methods.w8a8 import W8A8Method

        return W8A8Method()


def _describe(fmt: str, scheme: Any) -> str:
    w, a = scheme.weights, scheme.input_activations
    parts = [f"format {fmt!r}"]
    if w is not None:
        parts.append(f"weights {w.type}{w.num_bits} {w.strategy} symmetric={w.symmetric} group_size={w.group_size}")
    if a is not None:
        parts.append(f"activations {a.type}{a.num_bits} {a.strategy} dynamic={a.dynamic} symmetric={a.symmetric}")
    return "compressed-tensors scheme (" + ", ".join(parts) + ")"


def _format(fmt: str, scheme: Any) -> LayerFormat:
    """The LayerFormat of one config group, or a TreadleError naming the unsupported scheme."""
    w, a = scheme.weights, scheme.input_activations
    bad = TreadleError(f"{_describe(fmt, scheme)} is not supported (supported: int-quantized W8A8 with "
                       "per-channel weights and dynamic per-token activations, pack-quantized int4 W4A16)")
    if w is None or w.type != "int" or scheme.output_activations is not None:
        raise bad
    if fmt == "int-quantized":
        ok_a = a is not None and a.type == "int" and a.num_bits == 8 and a.strategy == "token" and a.dynamic is True \
            and a.symmetric
        if w.num_bits == 8 and w.symmetric and w.strategy == "channel" and ok_a:
            return IntQuantizedW8A8()
        raise bad
    if fmt == "pack-quantized" and a is None and w.num_bits == 4 and w.strategy in ("group", "channel"):
        if w.strategy == "group" and w.group_size not in (32, 64, 128):
            raise bad
        return PackQuantizedInt4(w.group_size if w.strategy == "group" else None, bool(w.symmetric),
                                 w.actorder == "group")
    raise bad


class CompressedTensorsQuantization(CheckpointQuantization):
    method = "compressed-tensors"

    def __init__(self, groups: list[tuple[list[str], LayerFormat]], ignore: list[str]) -> None:
        self.groups, self.ignore = groups, ignore

    @staticmethod
    def from_config(raw: dict[str, Any]) -> CompressedTensorsQuantization:
        from compressed_tensors.quantization import QuantizationConfig
        from pydantic import ValidationError

        try:
            config = QuantizationConfig.model_validate(raw)
        except ValidationError as e:
            first = e.errors()[0]
            raise TreadleError(f"compressed-tensors quantization_config is invalid: {first['msg']} at "
                               f"{'.'.join(map(str, first['loc']))}") from None
        if config.quantization_status != "compressed":
            raise TreadleError(f"compressed-tensors quantization_status {config.quantization_status!r} is not "
                               "supported (only 'compressed' checkpoints)")
        groups = []
        for scheme in config.config_groups.values():
            fmt = getattr(scheme, "format", None) or config.format
            groups.append((list(scheme.targets), _format(fmt, scheme)))
        return CompressedTensorsQuantization(groups, list(config.ignore or []))

    def formats(self) -> list[LayerFormat]:
        return [fmt for _, fmt in self.groups]

    def format_for(self, module: str) -> LayerFormat | None:
        from compressed_tensors.utils.match import match_name

        if module.endswith("embed_tokens"):  # an Embedding, never a "Linear" target
            return None
        if any(match_name(module, t) for t in self.ignore):
            return None
        for targets, fmt in self.groups:
            if any(t == "Linear" or match_name(module, t) for t in targets):
                return fmt
        return None
