"""Shared by the engine tests: run prompts through an offline LLM and check that it let go
of every KV block and request afterwards."""
from __future__ import annotations

from pathlib import Path

from treadle import LLM, SamplingParams


def run(model: Path | str, prompts: list[list[int]], params: SamplingParams,
        **kw: object) -> tuple[list[list[int]], LLM]:
    args: dict[str, object] = dict(num_kv_blocks=256, max_num_batched_tokens=64, block_size=16)
    args.update(kw)
    llm = LLM(str(model), **args)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def assert_no_leaks(llm: LLM) -> None:
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert not llm.engine.scheduler.requests and not llm.engine.has_unfinished_requests()


def generate_stepwise(llm: LLM, prompt: list[int], params: SamplingParams
                      ) -> tuple[list[int], list[tuple[int, list[int], int]]]:
    """Step one request through the engine: its tokens, and after each step (computed tokens,
    KV blocks it holds per layer group, pool blocks in use -- what the KV gauges show)."""
    engine = llm.engine
    rid = engine.add_request(None, {"prompt_token_ids": prompt}, params)
    trace: list[tuple[int, list[int], int]] = []
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
        req = engine.scheduler.requests.get(rid)
        if req is not None:
            kv = engine.kv_manager
            trace.append((req.num_computed_tokens, kv.blocks_held(rid), kv.pool.num_blocks - kv.num_free_blocks))
    return tokens, trace
