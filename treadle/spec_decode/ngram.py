"""The n-gram proposer (prompt lookup): match the last n tokens of a request (n from
``prompt_lookup_max`` down to ``prompt_lookup_min``) against its earlier prompt and output
tokens, and propose the tokens that followed the latest match: up to K, as many as the
request's recent verifies say are worth a verify row (``DraftLength``)."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from treadle.spec_decode.proposer import DraftLength, Proposer, ProposerStep


class NgramProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, lookup_min: int, lookup_max: int) -> None:
        super().__init__(num_speculative_tokens)
        self.lookup_min, self.lookup_max = lookup_min, lookup_max
        self.length = DraftLength(num_speculative_tokens)

    def propose(self, step: ProposerStep) -> dict[str, list[int]]:
        return {r.request_id: self.lookup(r.token_ids, self.length.of(r)) for r in step.requests if r.wants_drafts}

    def finish(self, request_ids: Iterable[str]) -> None:
        self.length.forget(request_ids)

    def lookup(self, tokens: Sequence[int], max_drafts: int | None = None) -> list[int]:
        """Up to ``min(K, max_drafts)`` draft tokens continuing ``tokens`` (prompt + output);
        [] when no n-gram of the allowed sizes recurs."""
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        if k <= 0 or len(tokens) < self.lookup_min + 1:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.lookup_max, len(arr) - 1), self.lookup_min - 1, -1):
            suffix = arr[-n:]
            windows = sliding_window_view(arr[:-1], n)  # every earlier n-gram (the suffix itself excluded)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the latest match's continuation
                return arr[start : start + k].tolist()
        return []
