"""xgrammar vs llguidance on this CPU, with a real vocabulary (SmolLM2's 49k tokens); without
llguidance installed (it is not a dependency), xgrammar alone.

For each engine: the time to compile a JSON schema (cold: a fresh compiler), and the time
per generated token to fill the next-token bitmask and advance the matcher, walking a
fixed valid JSON document token by token (each engine its own spelling of it), the two walks
interleaved token by token over the shorter one's length. Run:

    .venv/bin/python benchmarks/kernels/grammar_engines_cpu.py [model]
"""
from __future__ import annotations

import importlib.util
import json
import statistics
import time
from collections.abc import Callable

import harness
import torch
import xgrammar as xgr
from harness import Case

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


def walk(step: Callable[[int], None], ids: list[int]) -> Callable[[], None]:
    """Each call: one token of ``ids``, in order (fill the mask, apply it, advance)."""
    tokens = iter(ids)
    return lambda: step(next(tokens))


def xgrammar_walk(backend_json: str, vocab: list[str], vocab_size: int, eos: list[int],
                  ids: list[int]) -> tuple[float, Callable[[], None]]:
    """(compile seconds, one token's mask + advance)."""
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

    def step(t: int) -> None:
        matcher.fill_next_token_bitmask(mask)
        xgr.apply_token_bitmask_inplace(logits, mask)
        assert matcher.accept_token(t), t
    return compile_s, walk(step, ids)


def llguidance_walk(backend_json: str, vocab_size: int, eos: int, ids: list[int]) -> tuple[float, Callable[[], None]]:
    """(compile seconds, one token's mask + advance)."""
    import llguidance
    import llguidance.torch as lltorch

    tok = llguidance.LLTokenizer(backend_json, n_vocab=vocab_size, eos_token=eos)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA),
                                                            defaults={"whitespace_flexible": False})
    t0 = time.perf_counter()
    matcher = llguidance.LLMatcher(tok, grammar)
    compile_s = time.perf_counter() - t0
    assert not matcher.is_error(), matcher.get_error()
    mask = lltorch.allocate_token_bitmask(1, vocab_size)
    logits = torch.randn(1, vocab_size)

    def step(t: int) -> None:
        lltorch.fill_next_token_bitmask(matcher, mask, 0)
        lltorch.apply_token_bitmask_inplace(logits, mask)
        assert matcher.consume_token(t), (t, matcher.get_error())
    return compile_s, walk(step, ids)


def main() -> None:
    ap = harness.parser(__doc__, repeats=0, warmup=0, threads=1, clock="wall")
    ap.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    args = ap.parse_args()
    run = harness.start(args)
    source = open_model_source(args.model)
    tok = source.tokenizer
    backend_json = tok.backend.to_str()
    vocab_size = source.config.vocab_size
    by_id = {i: t for t, i in tok.backend.get_vocab(with_added_tokens=True).items()}
    vocab = [by_id.get(i, "") for i in range(vocab_size)]
    ids = tok.encode(json.dumps(DOC), add_special_tokens=False)  # xgrammar's compact form: ", " and ": "
    compact = tok.encode(json.dumps(DOC, separators=(",", ":")), add_special_tokens=False)  # llguidance's
    eos = list(tok.eos_token_ids)
    xgr_name = "xgrammar " + xgr.__version__ if hasattr(xgr, "__version__") else "xgrammar"
    walks = {xgr_name: xgrammar_walk(backend_json, vocab, vocab_size, eos, ids)}
    if importlib.util.find_spec("llguidance") is None:
        print("llguidance is not installed (pip install llguidance): xgrammar alone")
    else:
        import llguidance

        llg_name = "llguidance " + llguidance.get_version() if hasattr(llguidance, "get_version") else "llg"
        walks[llg_name] = llguidance_walk(backend_json, vocab_size, eos[0], compact)
    steps = min(args.repeats or len(compact), len(ids), len(compact))
    t = run.time([Case(name, fn) for name, (_, fn) in walks.items()], repeats=steps)
    us = {name: sorted(x * 1e6 for x in t.samples[name]) for name in t.names}
    run.table(["engine", "compile ms", "median us / token", "p90 us", "max us", f"median x {xgr_name}"],
              [[name, walks[name][0] * 1e3, statistics.median(us[name]), us[name][int(0.9 * len(us[name]))],
                us[name][-1], f"{t.ratio(name, xgr_name):.2f}"] for name in t.names], digits=1,
              title=f"vocab {vocab_size}, documents {len(ids)} / {len(compact)} tokens, {steps} steps timed")
    run.finish()


if __name__ == "__main__":
    main()
