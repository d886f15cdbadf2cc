"""Read a SentencePiece ``tokenizer.model`` (a ModelProto protobuf) without protobuf or
sentencepiece installed: the pieces, scores and types, and the two settings the
tokenizer needs. The BPE model becomes a ``tokenizers`` tokenizer via
``treadle.vocab.sentencepiece_bpe`` (the same builder GGUF's llama vocabularies use).

Wire format read here (field number: meaning), all else skipped:

    ModelProto      1: repeated SentencePiece   2: TrainerSpec   3: NormalizerSpec
    SentencePiece   1: piece (string)   2: score (float32)   3: type (enum, 1 = NORMAL ...)
    TrainerSpec     3: model_type (1 = UNIGRAM, 2 = BPE)   40: unk_id
    NormalizerSpec  3: add_dummy_prefix (bool, default true)
"""
from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from treadle.config import TreadleError

_BPE = 2


@dataclass
class SentencePieceModel:
    pieces: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    types: list[int] = field(default_factory=list)  # SentencePiece's enum: 1 normal, 2 unknown, 3 control, ...
    model_type: int = 1  # SentencePiece's default: unigram
    unk_id: int = 0
    add_dummy_prefix: bool = True


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value): varints and fixed ints as int, length-delimited as bytes."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
            yield number, value
        elif wire == 2:
            size, pos = _varint(data, pos)
            if pos + size > len(data):
                raise ValueError("truncated field")
            yield number, data[pos : pos + size]
            pos += size
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            yield number, int.from_bytes(data[pos : pos + width], "little")
            pos += width
        else:
            raise ValueError(f"unsupported wire type {wire}")


def parse_sentencepiece_model(data: bytes) -> SentencePieceModel:
    """The parts of a serialized ModelProto described above; ValueError if malformed."""
    model = SentencePieceModel()
    for number, value in _fields(data):
        if number == 1 and isinstance(value, bytes):
            piece, score, kind = "", 0.0, 1
            for n, v in _fields(value):
                if n == 1 and isinstance(v, bytes):
                    piece = v.decode("utf-8")
                elif n == 2 and isinstance(v, int):
                    score = struct.unpack("<f", v.to_bytes(4, "little"))[0]
                elif n == 3 and isinstance(v, int):
                    kind = v
            model.pieces.append(piece)
            model.scores.append(score)
            model.types.append(kind)
        elif number == 2 and isinstance(value, bytes):
            for n, v in _fields(value):
                if n == 3 and isinstance(v, int):
                    model.model_type = v
                elif n == 40 and isinstance(v, int):
                    model.unk_id = v
        elif number == 3 and isinstance(value, bytes):
            for n, v in _fields(value):
                if n == 3 and isinstance(v, int):
                    model.add_dummy_prefix = bool(v)
    return model


def read_sentencepiece_model(path: Path) -> SentencePieceModel:
    """A BPE ``tokenizer.model``; anything else is one TreadleError naming the file."""
    try:
        model = parse_sentencepiece_model(path.read_bytes())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise TreadleError(f"{path}: not a SentencePiece model ({e})") from None
    if not model.pieces:
        raise TreadleError(f"{path}: not a SentencePiece model (no pieces)")
    if model.model_type != _BPE:
        raise TreadleError(f"{path}: SentencePiece model type {model.model_type} is not supported (only BPE, "
                           "as Llama-2 and Mistral use); convert it to tokenizer.json with transformers")
    return model
