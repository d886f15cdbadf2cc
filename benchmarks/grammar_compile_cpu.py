"""What a structured-output grammar costs to compile, and the ways around compiling it twice
(issue 34; figures in docs/serving.md, "Structured-output compiles").

    PYTHONPATH=$PWD python benchmarks/grammar_compile_cpu.py [MODEL] [--properties 100,115,300,1000]
        [--serialize] [--dynamic] [--llguidance] [--repeats] [--pattern]

For JSON schemas of N optional string properties (the family whose compile grows steeply):
the grammar build alone and its size in characters (what CompileProbe's pre-check measures),
the eager compile (what the engine does), and optionally: serializing the compiled grammar
(shipping it from a compile process), xgrammar's dynamic compilation (masks built at first
use: the cost of the masks of a 200-token random walk through the grammar), and llguidance
(if importable) on the same walk. ``--repeats``: tiny regexes with counted repetitions
([^"]{0,16/64/256}); ``--pattern``: a 59-byte schema with a nested counted pattern (minutes).
One thread; a shared machine gives rough figures.
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch
import xgrammar as xgr

from treadle.loaders import open_model_source
from treadle.structured.compiler import tokenizer_info

WALK = 200


def schema(n: int) -> str:
    return json.dumps({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}})


def timed(fn):  # noqa: ANN001, ANN202 - a tiny helper
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def walk_masks(fill, accept, vocab: int, closers: set[int]) -> list[float]:  # noqa: ANN001
    """Seconds per mask over a random walk that avoids closing the object early."""
    rng, times, bitmask = random.Random(0), [], xgr.allocate_token_bitmask(1, vocab)
    for _ in range(WALK):
        t0 = time.perf_counter()
        if not fill(bitmask):
            break
        times.append(time.perf_counter() - t0)
        logits = torch.zeros(1, vocab)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        allowed = torch.nonzero(logits[0] == 0).flatten().tolist()
        if not allowed or not accept(rng.choice([a for a in allowed if a not in closers] or allowed)):
            break
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    ap.add_argument("--properties", default="100,115,150,300,1000")
    ap.add_argument("--serialize", action="store_true")
    ap.add_argument("--dynamic", action="store_true")
    ap.add_argument("--llguidance", action="store_true")
    ap.add_argument("--repeats", action="store_true")
    ap.add_argument("--pattern", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    source = open_model_source(args.model)
    stops = list(source.tokenizer.eos_token_ids)
    info = tokenizer_info(source.tokenizer, source.config.vocab_size, stops)
    closers = {i for i, t in enumerate(info.decoded_vocab) if b"}" in t}
    print(f"{args.model}: vocab {info.vocab_size}, xgrammar, 1 thread")
    small = [xgr.Grammar.from_regex(f'[^"]{{0,{n}}}') for n in (16, 64, 256)] if args.repeats else []
    if args.pattern:
        small.append(xgr.Grammar.from_json_schema(json.dumps({"type": "string", "pattern": "^([a-z]{1,30}\\s?){1,100}$"}),
                                                  any_whitespace=False))
    for grammar in small:
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        _, seconds = timed(lambda: compiler.compile_grammar(grammar))  # noqa: B023
        print(f"{len(str(grammar))}-character grammar with counted repetitions: compile {seconds:.3f} s", flush=True)
    for n in (int(x) for x in args.properties.split(",") if x):
        grammar, build_s = timed(lambda: xgr.Grammar.from_json_schema(schema(n), any_whitespace=False))  # noqa: B023
        eager = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        compiled, compile_s = timed(lambda: eager.compile_grammar(grammar))  # noqa: B023
        line = f"{n} properties: grammar {len(str(grammar))} chars, build {build_s * 1e3:.1f} ms, compile {compile_s:.3f} s"
        if args.serialize:
            text, ser_s = timed(compiled.serialize_json)
            _, de_s = timed(lambda: xgr.CompiledGrammar.deserialize_json(text, info))  # noqa: B023
            line += f"; serialize_json {ser_s:.2f} s ({len(text) / 1e6:.0f} MB), deserialize {de_s:.2f} s"
        if args.dynamic:
            lazy = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False, enable_dynamic_compilation=True)
            dyn, dyn_s = timed(lambda: lazy.compile_grammar(grammar))  # noqa: B023
            m = xgr.GrammarMatcher(dyn)
            t = walk_masks(lambda b: (m.fill_next_token_bitmask(b, 0), True)[1], m.accept_token,  # noqa: B023
                           info.vocab_size, closers)
            line += f"; dynamic: compile {dyn_s:.3f} s, masks max {max(t):.3f} s, sum {sum(t):.2f} s over {len(t)}"
        if args.llguidance:
            line += "; " + llguidance_walk(source, n, info.vocab_size, stops[0], closers)
        print(line, flush=True)


def llguidance_walk(source, n: int, vocab: int, eos: int, closers: set[int]) -> str:  # noqa: ANN001
    import llguidance
    import llguidance.torch as lt

    tok = llguidance.LLTokenizer(source.tokenizer.backend.to_str(), n_vocab=vocab, eos_token=eos)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema(n), defaults={"whitespace_flexible": False})
    m, build_s = timed(lambda: llguidance.LLMatcher(tok, grammar))
    t = walk_masks(lambda b: (lt.fill_next_token_bitmask(m, b, 0), not m.is_error())[1], m.consume_token,
                   vocab, closers)
    error = m.get_error().splitlines()[0] if m.is_error() else "none"
    return f"llguidance: matcher {build_s:.3f} s, masks max {max(t, default=0):.3f} s over {len(t)}, error: {error}"


if __name__ == "__main__":
    main()
