"""The quantization_config of a published checkpoint -> its parsed form, one parser per
``quant_method`` (the formats live in compressed_tensors.py, gptq.py, awq.py; the common
contract in checkpoint.py)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from treadle.config import TreadleError
from treadle.quantization.formats.awq import AWQQuantization
from treadle.quantization.formats.checkpoint import CHECKPOINT_METHODS, CheckpointQuantization
from treadle.quantization.formats.compressed_tensors import CompressedTensorsQuantization
from treadle.quantization.formats.gptq import GPTQQuantization

_PARSERS: dict[str, Callable[[dict[str, Any]], CheckpointQuantization]] = {
    "compressed-tensors": CompressedTensorsQuantization.from_config,
    "gptq": GPTQQuantization.from_config,
    "awq": AWQQuantization.from_config,
}
assert tuple(_PARSERS) == CHECKPOINT_METHODS


def parse_quantization_config(raw: Any, where: Path) -> CheckpointQuantization:
    """config.json's ``quantization_config`` -> its parsed form; an unknown quant_method or an
    unsupported scheme is a one-line TreadleError naming it."""
    if not isinstance(raw, dict):
        raise TreadleError(f"{where}: quantization_config must be a JSON object")
    method = raw.get("quant_method")
    parser = _PARSERS.get(method) if isinstance(method, str) else None
    if parser is not None:
        try:
            return parser(raw)
        except TreadleError as e:
            raise TreadleError(f"{where}: {e}") from None
    raise TreadleError(f"{where}: quantization_config quant_method {method!r} is not supported "
                       f"(supported: {', '.join(CHECKPOINT_METHODS)})")


def read_checkpoint_quantization(config_json: dict[str, Any], where: Path) -> CheckpointQuantization | None:
    """The checkpoint's quantization, or None for a float checkpoint."""
    raw = config_json.get("quantization_config")
    return None if raw is None else parse_quantization_config(raw, where)
