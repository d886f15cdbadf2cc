"""GrammarCompiler: StructuredOutputsParams -> an xgrammar CompiledGrammar for one vocabulary,
cached by spec (LRU). Thread-safe: the engine compiles off its step loop (an in-process
server's tokenizer thread, the engine process's compile thread, or a worker process's grammar
thread when the spec is announced), so the step that adds the request finds it cached; the
model runner compiles only on the rare miss. ``compiles`` counts the misses.

Why xgrammar: measured against llguidance on this CPU with SmolLM2's 49k vocabulary
(benchmarks/kernels/grammar_engines_cpu.py, docs/benchmarks-archive.md), its per-token mask time is as
low and has no multi-second first-token outliers; it also takes EBNF grammars directly.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import xgrammar as xgr

from treadle.config import InvalidRequestError
from treadle.sampling_params import STRUCTURED_PARAM as PARAM
from treadle.sampling_params import StructuredOutputsParams
from treadle.structured.probe import spec_text
from treadle.structured.probe_child import build, error
from treadle.tokenizer import Tokenizer

CACHE_SIZE = 256


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of our tokenizer: every token's text as the model numbers them
    (ids the tokenizer lacks are empty and never allowed), its kind (byte-level or
    SentencePiece byte-fallback, read from tokenizer.json), and the stop tokens."""
    backend = tokenizer.backend
    by_id = {i: t for t, i in backend.get_vocab(with_added_tokens=True).items()}
    size = max(vocab_size, max(by_id, default=-1) + 1)
    encoded = [by_id.get(i, "") for i in range(size)]
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=size, stop_token_ids=list(stop_token_ids),
                             add_prefix_space=meta["add_prefix_space"])


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = self.info.vocab_size
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (cache misses): a test counts them

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec``; an invalid schema, regex or grammar is an
        InvalidRequestError naming the problem."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile(spec)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        self.compiles += 1
        if spec.kind == "json_object":  # OpenAI's json_object: an object, compact like the schemas
            return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        try:
            return self._compiler.compile_grammar(build(xgr, spec.kind, spec_text(spec)))
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError subclasses
            raise InvalidRequestError(error(spec.kind, e), PARAM) from None
