"""Hugging Face model directories: config.json, *.safetensors (single or sharded),
generation_config.json, tokenizer files.

Weights are streamed: each shard is memory-mapped with ``safe_open`` and its
tensors are handed out one at a time, each read exactly once.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from treadle.config import ModelConfig, TreadleError
from treadle.loaders.expected import check_tensors, expected_tensors, is_ignored
from treadle.loaders.source import ModelSource
from treadle.models.registry import supported_architectures
from treadle.quantization.formats.checkpoint import check_dtypes, quantized_expected
from treadle.quantization.formats.published import read_checkpoint_quantization
from treadle.tokenizer import Tokenizer, read_json_object

_INDEX = "model.safetensors.index.json"


def _read_json(path: Path, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise TreadleError(f"{path}: no such file (not a Hugging Face model directory?)")
        return None
    return read_json_object(path)


def _eos_ids(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def read_hf_config(path: Path) -> ModelConfig:
    """config.json, with generation_config.json's EOS ids taking precedence."""
    raw = _read_json(path / "config.json", required=True)
    assert raw is not None
    gen = _read_json(path / "generation_config.json", required=False) or {}
    try:
        config = ModelConfig.from_hf(raw, eos_override=_eos_ids(gen.get("eos_token_id")))
    except (KeyError, TypeError, ValueError) as e:
        raise TreadleError(f"{path / 'config.json'}: missing or invalid field {e}") from None
    except TreadleError as e:
        raise TreadleError(f"{path / 'config.json'}: {e}") from None
    if config.architecture not in supported_architectures():
        raise TreadleError(
            f"{path / 'config.json'}: architecture {config.architecture!r} is not supported; "
            f"supported: {', '.join(supported_architectures())}"
        )
    return config


def weight_files(path: Path) -> list[Path]:
    """The safetensors files holding the weights: from the shard index when there is one."""
    index_file = path / _INDEX
    index = _read_json(index_file, required=False)
    if index is not None:
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise TreadleError(f"{index_file}: no weight_map")
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise TreadleError(f"{f}: shard listed in {_INDEX} is missing")
        return files
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise TreadleError(f"{path}: no *.safetensors weights found (other formats are not supported)")
    return files


def _shard_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """A shard's tensor names and shapes from its header (validated against the file
    size by safetensors); no tensor data is read."""
    try:
        with safe_open(str(file), framework="pt") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise TreadleError(f"{file}: not a valid safetensors file ({e})") from None


_REMAP_EVERY = 16 * 2**20  # elements read through one mapping before it is dropped


def _batches(keys: list[str], shapes: dict[str, tuple[int, ...]], limit: int) -> Iterator[list[str]]:
    """Split a shard's keys into runs of at most ``limit`` elements (a bigger tensor alone)."""
    batch: list[str] = []
    size = 0
    for key in keys:
        numel = math.prod(shapes[key])
        if batch and size + numel > limit:
            yield batch
            batch, size = [], 0
        batch.append(key)
        size += numel
    if batch:
        yield batch


class SlicedTensor:
    """A checkpoint tensor not read yet (valid until the stream moves on): ``narrow`` reads
    only the rows or columns asked for -- a tensor-parallel rank's part --, ``read`` all of it."""

    def __init__(self, handle: Any) -> None:
        self._slice = handle
        self.shape = tuple(handle.get_shape())

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, size: int) -> torch.Tensor:
        return self._slice[start : start + size] if dim == 0 else self._slice[:, start : start + size]

    def read(self) -> torch.Tensor:
        return self._slice[:]


def stream_safetensors(
    shards: list[tuple[Path, list[str]]], shapes: dict[str, tuple[int, ...]], config: ModelConfig,
    sliced: bool = False,
) -> Iterator[tuple[str, Any]]:
    """Yield (hf_name, tensor) one at a time, each read once; a tensor is dropped before
    the next is read. The file is re-mapped every ~64 MB so that pages already copied
    out stop counting toward the process's resident set (a whole mapped shard would).
    ``sliced``: yield ``SlicedTensor``s instead, so a rank reads only its part."""
    for file, keys in shards:
        wanted = [key for key in keys if not is_ignored(key, config)]
        try:
            for batch in _batches(wanted, shapes, _REMAP_EVERY):
                with safe_open(str(file), framework="pt") as f:
                    for key in batch:
                        tensor = SlicedTensor(f.get_slice(key)) if sliced else f.get_tensor(key)
                        yield key, tensor
                        del tensor
        except (SafetensorError, OSError) as e:
            raise TreadleError(f"{file}: cannot read weights ({e})") from None


def open_hf_dir(path: str | Path, skip_tokenizer_init: bool = False) -> ModelSource:
    path = Path(path)
    if not path.is_dir():
        raise TreadleError(f"{path}: no such directory")
    config = read_hf_config(path)
    shards: list[tuple[Path, list[str]]] = []
    found: dict[str, tuple[int, ...]] = {}
    for file in weight_files(path):
        shapes = _shard_shapes(file)
        dup = found.keys() & shapes.keys()
        if dup:
            raise TreadleError(f"{file}: tensor {sorted(dup)[0]!r} also appears in another shard")
        found |= shapes
        shards.append((file, list(shapes)))
    quant = read_checkpoint_quantization(read_json_object(path / "config.json"), path / "config.json")
    float_expected = expected_tensors(config)
    check_tensors(path, found, config, None if quant is None else quantized_expected(quant, float_expected))
    if quant is not None:
        check_dtypes(quant, float_expected, [file for file, _ in shards])
    tokenizer = None if skip_tokenizer_init else Tokenizer.from_hf_dir(path, extra_eos_token_ids=config.eos_token_ids)
    return ModelSource(
        path=path,
        config=config,
        weights=lambda: stream_safetensors(shards, found, config),
        sliced_weights=lambda: stream_safetensors(shards, found, config, sliced=True),
        tokenizer=tokenizer,
        checkpoint_quantization=quant,
    )
