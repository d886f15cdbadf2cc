"""Incremental detokenization with stop strings.

Text is produced by decoding a short window of tokens twice (with and without
the newest ones) and keeping the difference, so multi-byte UTF-8 characters
split across tokens appear only once complete, and tokenizers that drop a
leading space at the start of a decode do not lose it mid-stream.
"""
from __future__ import annotations

from treadle.sampling_params import SamplingParams
from treadle.tokenizer import Tokenizer

_CONTEXT = 5  # prompt tokens kept as left context for the first decodes


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer | None, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """``tokenizer`` None: no text at all (token ids only)."""
        self.tokenizer = tokenizer
        self.skip_special = params.skip_special_tokens
        self.stops: list[str] = list(params.stop or [])
        self.min_tokens = params.min_tokens  # stop strings end a request only after this many tokens (as vLLM)
        self.keep_stop = params.include_stop_str_in_output
        self._n_out = 0
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._ids = list(prompt_token_ids[-_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        self._emitted = 0

    def add_token(self, token_id: int) -> str | None:
        """Append one token; returns the stop string it completed, if any."""
        if self.tokenizer is None:
            return None
        self._n_out += 1
        self._ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self.skip_special)
        full = decode(self._ids[self._prefix_offset :], skip_special_tokens=self.skip_special)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # an incomplete character: wait for more bytes
        before = len(self.text)
        self.text += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._match_stop(before) if self._n_out > self.min_tokens else None

    def _match_stop(self, before: int) -> str | None:
        hits = [(at, stop) for stop in self.stops if (at := self.text.find(stop, max(0, before - len(stop) + 1))) >= 0]
        if not hits:
            return None
        at, stop = min(hits)
        self.text = self.text[: at + len(stop) if self.keep_stop else at]
        return stop

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; while running, a tail that could begin a
        stop string is held back."""
        end = len(self.text) if finished or not self.stops else max(self._emitted, len(self.text) - self._hold)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
