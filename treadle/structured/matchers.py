"""GrammarMatchers: the model runner's side of structured output.

One xgrammar matcher per live constrained request (built from the compiled grammar when
the runner first sees the request). Each step, before sampling:

    logits [num_rows, V] --mask(logits, row request ids)--> disallowed tokens of the
    constrained rows set to -inf (one bitmask row each); unconstrained rows untouched

and after sampling ``accept`` advances each matcher by its row's token. When the grammar is
complete only the request's stop tokens stay allowed, so the sampled stop token finishes the
request through the scheduler's ordinary EOS rule. Nothing here runs when no live request
is constrained (``active`` is False), so unconstrained batches pay nothing.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from treadle.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:  # xgrammar is imported on first use: an engine that never constrains never loads it
    import xgrammar as xgr

    from treadle.structured.compiler import GrammarCompiler

logger = logging.getLogger("treadle")


class GrammarMatchers:
    def __init__(self, compiler: Callable[[], GrammarCompiler]) -> None:
        """``compiler``: gives the (shared, lazily built) GrammarCompiler on first need."""
        self._compiler_factory = compiler
        self._compiler: GrammarCompiler | None = None
        self._matchers: dict[str, xgr.GrammarMatcher] = {}
        self._bitmask: torch.Tensor | None = None  # [rows, ceil(V / 32)] int32, reused

    @property
    def active(self) -> bool:
        return bool(self._matchers)

    def prepare(self, spec: StructuredOutputsParams) -> None:
        """Compile ``spec`` into the shared cache now (thread-safe), so that its ``add`` inside a
        step finds it compiled; a bad spec is an InvalidRequestError."""
        if self._compiler is None:
            self._compiler = self._compiler_factory()
        self._compiler.compile(spec)

    def add(self, request_id: str, spec: StructuredOutputsParams, stop_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        if self._compiler is None:
            self._compiler = self._compiler_factory()
        compiled = self._compiler.compile(spec)  # a cache hit when prepared
        self._matchers[request_id] = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids))

    def constrains(self, request_id: str) -> bool:
        """Whether ``request_id`` has a grammar (the runner proposes no drafts for it)."""
        return request_id in self._matchers

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def mask(self, logits: torch.Tensor, request_ids: Sequence[str]) -> None:
        """logits [len(request_ids), V], in place: -inf where a row's grammar forbids the token."""
        import xgrammar as xgr

        rows = [(i, m) for i, rid in enumerate(request_ids) if (m := self._matchers.get(rid)) is not None]
        if not rows:
            return
        assert self._compiler is not None
        vocab = min(logits.shape[-1], self._compiler.vocab_size)
        if self._bitmask is None or self._bitmask.shape[0] < logits.shape[0]:
            self._bitmask = xgr.allocate_token_bitmask(max(logits.shape[0], 8), self._compiler.vocab_size)
        bitmask = self._bitmask[: logits.shape[0]]
        for i, matcher in rows:
            matcher.fill_next_token_bitmask(bitmask, i)
        indices = [i for i, _ in rows]
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), vocab_size=vocab,
                                        indices=indices)
        if logits.shape[-1] > vocab:  # padded model vocabulary: those ids are never in a grammar
            logits[indices, vocab:] = float("-inf")

    def accept(self, request_id: str, token_id: int) -> None:
        """Advance ``request_id``'s matcher (if constrained) by its sampled token."""
        matcher = self._matchers.get(request_id)
        if matcher is not None and not matcher.is_terminated() and not matcher.accept_token(token_id):
            logger.error("request %s: sampled token %d that its grammar refuses", request_id, token_id)
