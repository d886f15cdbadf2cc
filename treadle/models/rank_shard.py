"""One tensor-parallel rank's part of a checkpoint tensor, derived from the layout's ``Split``
(no per-architecture table beyond the layout)::

    Split.COLUMN  rows: each part of a packed layer (q | k | v, gate | up) cut separately
    Split.ROW     columns (input features); a bias goes whole to rank 0, zeros elsewhere; a
                  per-output-channel scale [out, 1] (W8A8 checkpoints) goes whole to every rank
    Split.VOCAB   rows by vocabulary range, the last rank padded with zero rows
    REPLICATED    unchanged

Tensors arrive as float tensors or as GGUF blocks (rows of 32- or 256-input blocks, a
NamedTuple with ``qtype``, ``data`` [rows, row bytes] and ``shape`` [rows, in]): rows cut
anywhere, columns only at block boundaries. Only the rank's part is copied out of the (memory-mapped)
checkpoint tensor: a tensor not read yet (``narrow`` and ``read``, the loader's
``SlicedTensor``) is narrowed before it is read, and tensors of another pipeline stage are never
read at all.
"""
from __future__ import annotations

from typing import Any

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from treadle.config import ModelConfig, TreadleError
from treadle.distributed.sharding import intermediate_unit, rank_range, shard_config
from treadle.models.layout import LinearLayout, ModelLayout, Split


def _is_blocks(t: Any) -> bool:
    return hasattr(t, "qtype") and hasattr(t, "data")


def _narrow(t: Any, dim: int, start: int, size: int) -> Any:
    if not _is_blocks(t):
        return t.narrow(dim, start, size)
    rows, cols = t.shape
    if dim == 0:
        return t._replace(data=t.data[start : start + size], shape=(size, cols))
    inputs, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[t.qtype]]
    if start % inputs or size % inputs:
        raise TreadleError(f"a {t.qtype} tensor cannot be split at column {start} (+{size}): "
                           f"its GGUF blocks hold {inputs} inputs; choose another tensor_parallel_size")
    return t._replace(data=t.data[:, start // inputs * nbytes : (start + size) // inputs * nbytes],
                      shape=(rows, size))


def _cat_rows(parts: list[Any]) -> Any:
    if not _is_blocks(parts[0]):
        return torch.cat(parts)
    data = torch.cat([p.data for p in parts])
    return parts[0]._replace(data=data, shape=(data.shape[0], parts[0].shape[1]))


def _pad_rows(t: Any, rows: int) -> Any:
    have = t.shape[0]
    if have == rows:
        return t
    if _is_blocks(t):
        data = torch.zeros(rows, t.data.shape[1], dtype=t.data.dtype)  # d = 0: zero weights
        data[:have] = t.data
        return t._replace(data=data, shape=(rows, t.shape[1]))
    out = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype)
    out[:have] = t
    return out


class RankSharder:
    """Cuts checkpoint tensors down to rank ``tp_rank`` of ``tp`` for a model with ``layout``."""

    def __init__(self, layout: ModelLayout, cfg: ModelConfig, tp: int, tp_rank: int) -> None:
        self.layout, self.full, self.tp, self.rank = layout, cfg, tp, tp_rank
        self.local = shard_config(cfg, tp, tp_rank)
        self.unit = intermediate_unit(cfg.intermediate_size)

    def __call__(self, hf_name: str, tensor: Any) -> Any:
        part = self._part(hf_name, tensor)
        return part.read() if hasattr(part, "read") else part

    def _part(self, hf_name: str, tensor: Any) -> Any:
        if self.tp == 1:
            return tensor
        lin, part = self.layout.linear_for(hf_name)
        if lin is None:
            module = hf_name.rpartition(".")[0]
            if module in (self.layout.embed, self.layout.lm_head):
                return self._vocab_rows(tensor)
            return tensor  # norms: replicated
        if lin.split == Split.COLUMN:
            return self._column(lin, part, tensor)
        if lin.split == Split.ROW:
            return self._row(lin, tensor)
        return tensor

    def _rows_of(self, lin: LinearLayout, index: int, tensor: Any) -> Any:
        size_fn = lin.parts[index][1]
        full, local = size_fn(self.full), size_fn(self.local)
        return _narrow(tensor, 0, rank_range(full, local, self.tp, self.rank, self.unit), local)

    def _column(self, lin: LinearLayout, part: int | None, tensor: Any) -> Any:
        if part is not None or len(lin.parts) == 1:
            return self._rows_of(lin, part or 0, tensor)
        # the checkpoint holds the packed layer: cut each part out of it, then stack again
        pieces, start = [], 0
        for i, rows in enumerate(lin.output_sizes(self.full)):
            pieces.append(self._rows_of(lin, i, _narrow(tensor, 0, start, rows)))
            start += rows
        return _cat_rows(pieces)

    def _row(self, lin: LinearLayout, tensor: Any) -> Any:
        if not _is_blocks(tensor) and tensor.dim() == 1:  # bias: added once, by rank 0
            return tensor if self.rank == 0 else torch.zeros(tensor.shape)
        full, local = lin.in_features(self.full), lin.in_features(self.local)
        if not _is_blocks(tensor) and tensor.shape[1] == 1 < full:  # a per-output-channel scale [out, 1]
            return tensor
        return _narrow(tensor, 1, rank_range(full, local, self.tp, self.rank, self.unit), local)

    def _vocab_rows(self, tensor: Any) -> Any:
        per_rank = self.local.vocab_size
        start = per_rank * self.rank
        size = max(0, min(per_rank, self.full.vocab_size - start))
        return _pad_rows(_narrow(tensor, 0, start, size), per_rank)
