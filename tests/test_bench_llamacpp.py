"""The optional llama.cpp peer (skipped unless llama-cpp-python and the SmolLM2 GGUF are installed):
its batched slots must decode what llama-cpp-python's own one-sequence API decodes."""
from __future__ import annotations

import pytest

from treadle.bench.workloads import LengthRange, WorkloadSpec, make_workload
from treadle.config import TreadleError

pytest.importorskip("llama_cpp")


def test_batched_slots_match_high_level_api():
    from treadle.bench.llamacpp import LlamaCppBackend

    try:
        backend = LlamaCppBackend("smollm2-135m-instruct", n_ctx=128, n_threads=1)
    except TreadleError as e:
        pytest.skip(str(e))
    reqs = make_workload(WorkloadSpec("random", 3, LengthRange(10, 30), LengthRange(3, 6), seed=2), backend.n_vocab)
    tokens: list[int] = []
    argmax = backend._argmax

    def spy(ctx, row):  # noqa: ANN001, ANN202 - records the single slot's greedy choices
        tokens.append(argmax(ctx, row))
        return tokens[-1]

    result = backend.run(reqs, 3)
    assert sorted(r.num_output_tokens for r in result.records) == sorted(r.output_len for r in reqs)
    backend._argmax = spy
    backend.run(reqs[:1], 1)
    ref = backend.llm.create_completion(reqs[0].prompt_token_ids, max_tokens=reqs[0].output_len, temperature=0.0,
                                        logit_bias={backend.eos: -1e9})
    assert backend.llm.detokenize(tokens).decode(errors="replace") == ref["choices"][0]["text"]
