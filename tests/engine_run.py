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
