"""xgrammar vs llguidance on this CPU, with a real vocabulary (SmolLM2's 49k tokens).

For each engine: the time to compile a JSON schema (cold: a fresh compiler), and the time
per generated token to fill the next-token bitmask and advance the matcher, walking a
fixed valid JSON document token by token. Run:

    PYTHONPATH=$PWD python benchmarks/grammar_engines_cpu.py [model]
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import llguidance
import llguidance.torch as lltorch
import torch
import xgrammar as xgr

from treadle.loaders import open_model_source

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"]},
        "kind": {"enum": ["person", "robot", "alien"]},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}
DOC = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "poetry"],
       "address": {"city": "London"}, "kind": "person"}


def bench_xgrammar(backend_json: str, vocab: list[str], vocab_size: int, eos: list[int], ids: list[int]) -> tuple:
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend_json)
    info = xgr.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=vocab_size, stop_token_ids=eos,
                             add_prefix_space=meta["add_prefix_space"])
    t0 = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False)
    compile_s = time.perf_counter() - t0
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab_size)
    logits = torch.randn(1, vocab_size)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        xgr.apply_token_bitmask_inplace(logits, mask)
        assert matcher.accept_token(t), t
        times.append(time.perf_counter() - t0)
    return compile_s, times


def bench_llguidance(backend_json: str, vocab_size: int, eos: int, ids: list[int]) -> tuple:
    tok = llguidance.LLTokenizer(backend_json, n_vocab=vocab_size, eos_token=eos)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA),
                                                            defaults={"whitespace_flexible": False})
    t0 = time.perf_counter()
    matcher = llguidance.LLMatcher(tok, grammar)
    compile_s = time.perf_counter() - t0
    assert not matcher.is_error(), matcher.get_error()
    mask = lltorch.allocate_token_bitmask(1, vocab_size)
    logits = torch.randn(1, vocab_size)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        lltorch.fill_next_token_bitmask(matcher, mask, 0)
        lltorch.apply_token_bitmask_inplace(logits, mask)
        assert matcher.consume_token(t), (t, matcher.get_error())
        times.append(time.perf_counter() - t0)
    return compile_s, times


def main() -> None:
    torch.set_num_threads(1)
    source = open_model_source(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct")
    tok = source.tokenizer
    backend_json = tok.backend.to_str()
    vocab_size = source.config.vocab_size
    by_id = {i: t for t, i in tok.backend.get_vocab(with_added_tokens=True).items()}
    vocab = [by_id.get(i, "") for i in range(vocab_size)]
    ids = tok.encode(json.dumps(DOC), add_special_tokens=False)  # xgrammar's compact form: ", " and ": "
    compact = tok.encode(json.dumps(DOC, separators=(",", ":")), add_special_tokens=False)  # llguidance's
    eos = list(tok.eos_token_ids)
    print(f"vocab {vocab_size}, document {len(ids)} tokens, torch threads 1")
    for name, run in (("xgrammar " + xgr.__version__ if hasattr(xgr, "__version__") else "xgrammar",
                       lambda: bench_xgrammar(backend_json, vocab, vocab_size, eos, ids)),
                      ("llguidance " + llguidance.get_version() if hasattr(llguidance, "get_version") else "llg",
                       lambda: bench_llguidance(backend_json, vocab_size, eos[0], compact))):
        compile_s, times = run()
        print(f"{name:22s} compile {compile_s * 1e3:8.1f} ms   mask+advance per token: "
              f"median {statistics.median(times) * 1e6:7.1f} us, p90 "
              f"{sorted(times)[int(0.9 * len(times))] * 1e6:7.1f} us, max {max(times) * 1e6:7.1f} us")


if __name__ == "__main__":
    main()
