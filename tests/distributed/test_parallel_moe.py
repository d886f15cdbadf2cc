"""Mixtures of experts over two gloo ranks (worker processes): with expert parallelism each rank
holds half the experts (and half the shared expert's columns), without it every rank holds a
half of every expert's columns; either way greedy tokens are identical to one rank and
logprobs close, with chunked prefill and the prefix cache on."""
from __future__ import annotations

from pathlib import Path

import pytest
from test_models_moe import make_moe_model
from test_parallel import KW, assert_same, run

from treadle import LLM

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.server, pytest.mark.slow]


def _run(model: str, **kw: object) -> list:
    llm = LLM(model, **KW, **kw)
    try:
        out = run(llm)
        assert llm.engine.health() is None
        return out
    finally:
        llm.shutdown()


def test_two_ranks_are_token_identical_to_one(tmp_path: Path) -> None:
    """Qwen2-MoE: routed experts, the shared expert and a dense layer (mlp_only_layers)."""
    make_moe_model(tmp_path, "qwen2-moe")
    one = _run(str(tmp_path))
    assert_same(_run(str(tmp_path), tensor_parallel_size=2, enable_expert_parallel=True), one)
    assert_same(_run(str(tmp_path), tensor_parallel_size=2), one)  # every expert's columns split instead
