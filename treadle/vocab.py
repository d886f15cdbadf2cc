"""Build ``tokenizers.Tokenizer`` objects from bare vocabularies, as stored in GGUF
metadata and llama2.c tokenizer files.

Two kinds exist in the wild:

- SentencePiece-style BPE (GGUF ``tokenizer.ggml.model == "llama"``, llama2.c): pieces
  with scores, '▁' for spaces, ``<0xNN>`` byte-fallback pieces. The encoder repeatedly
  merges the adjacent pair whose merged piece scores highest, which is BPE with merges
  ranked by the merged piece's score.
- Byte-level BPE (``"gpt2"``): pieces spelled in GPT-2's byte alphabet, explicit merges.

The ``tokenizers`` library does the tokenizing; this module only assembles it.
"""
from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from treadle.config import TreadleError

SPACE_MARK = "\u2581"  # '▁', SentencePiece's visible space


class TokenType(IntEnum):
    """llama.cpp's token types, as stored in ``tokenizer.ggml.token_type``."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# llama.cpp pre-tokenizer names -> how text is split before byte-level BPE.
# None: GPT-2's own split (tokenizers' ByteLevel regex).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BYTE_LEVEL_SPLITS: dict[str, str | None] = {
    "default": None,
    "gpt2": None,
    "gpt-2": None,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
}
# GPT-2's split after every digit stands alone (llama.cpp's "\p{N}" rule; the
# original SmolLM2/StarCoder tokenizer.json has Digits(individual_digits=True)).
_DIGIT_SPLIT_PRES = frozenset({"smollm", "starcoder", "refact", "codeshell"})


def score_ranked_merges(pieces: Sequence[str], scores: Sequence[float], mergeable: Sequence[bool]) -> list[tuple[str, str]]:
    """Every way to write a mergeable piece as two vocabulary pieces, best-scoring
    merged piece first (ties: lower piece ids first, so the order is deterministic)."""
    ids = {p: i for i, p in enumerate(pieces) if mergeable[i]}
    ranked: list[tuple[float, int, int, int]] = []
    for piece, pid in ids.items():
        for cut in range(1, len(piece)):
            left, right = ids.get(piece[:cut]), ids.get(piece[cut:])
            if left is not None and right is not None:
                ranked.append((-scores[pid], pid, left, right))
    ranked.sort()
    return [(pieces[left], pieces[right]) for _, _, left, right in ranked]


def _added_tokens(pieces: Sequence[str], types: Sequence[int]) -> tuple[list[AddedToken], list[AddedToken]]:
    special = [
        AddedToken(p, special=True, normalized=False)
        for p, t in zip(pieces, types)
        if t in (TokenType.CONTROL, TokenType.UNKNOWN)
    ]
    user = [AddedToken(p, special=False, normalized=False) for p, t in zip(pieces, types) if t == TokenType.USER_DEFINED]
    return special, user


def sentencepiece_bpe(
    pieces: Sequence[str],
    scores: Sequence[float],
    types: Sequence[int],
    unk_id: int | None,
    add_space_prefix: bool = True,
) -> BackendTokenizer:
    """A SentencePiece-style BPE tokenizer with byte fallback."""
    mergeable = [t in (TokenType.NORMAL, TokenType.USER_DEFINED) for t in types]
    vocab: dict[str, int] = {}
    for i, piece in enumerate(pieces):
        vocab.setdefault(piece, i)
    unk = pieces[unk_id] if unk_id is not None else None
    model = models.BPE(
        vocab=vocab,
        merges=score_ranked_merges(pieces, scores, mergeable),
        unk_token=unk,
        byte_fallback=True,
        fuse_unk=True,
    )
    tok = BackendTokenizer(model)
    # As SentencePiece and llama.cpp do: a space prefix on every text run (also one
    # that follows a special token), spaces spelled '▁', no splitting before BPE.
    spaces: list[normalizers.Normalizer] = [normalizers.Prepend(SPACE_MARK)] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*spaces, normalizers.Replace(" ", SPACE_MARK)])
    steps: list[decoders.Decoder] = [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    special, user = _added_tokens(pieces, types)
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    return tok


def byte_level_bpe(
    pieces: Sequence[str], merges: Sequence[str], types: Sequence[int], pre: str | None
) -> BackendTokenizer:
    """A GPT-2-style byte-level BPE tokenizer; ``pre`` is llama.cpp's pre-tokenizer name."""
    pre = pre or "default"
    if pre not in _BYTE_LEVEL_SPLITS and pre not in _DIGIT_SPLIT_PRES:
        known = sorted(set(_BYTE_LEVEL_SPLITS) | _DIGIT_SPLIT_PRES)
        raise TreadleError(f"pre-tokenizer {pre!r} is not supported (supported: {', '.join(known)})")
    vocab: dict[str, int] = {}
    for i, piece in enumerate(pieces):
        vocab.setdefault(piece, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    model = models.BPE(vocab=vocab, merges=[(a, b) for a, b in pairs], fuse_unk=False)
    tok = BackendTokenizer(model)
    split = _BYTE_LEVEL_SPLITS.get(pre)
    if split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(False, use_regex=False)]
        )
    elif pre in _DIGIT_SPLIT_PRES:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(False, use_regex=True)]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special, user = _added_tokens(pieces, types)
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    return tok
