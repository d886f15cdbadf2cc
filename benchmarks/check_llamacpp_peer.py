"""Check the optional llama.cpp peer (needs `pip install 'treadle[peers]'` and the SmolLM2 GGUF):
its batched slots must decode what llama-cpp-python's own one-sequence API decodes.

    .venv/bin/python benchmarks/check_llamacpp_peer.py

Not part of the test suite, because the peer is an optional extra that CI never installs.
Exits non-zero on a mismatch.
"""
from __future__ import annotations

import sys

from treadle.bench.llamacpp import LlamaCppBackend
from treadle.bench.workloads import LengthRange, WorkloadSpec, make_workload


def main() -> int:
    backend = LlamaCppBackend("smollm2-135m-instruct", n_ctx=128, n_threads=1)
    reqs = make_workload(WorkloadSpec("random", 3, LengthRange(10, 30), LengthRange(3, 6), seed=2), backend.n_vocab)
    result = backend.run(reqs, 3)
    counts_ok = sorted(r.num_output_tokens for r in result.records) == sorted(r.output_len for r in reqs)
    tokens: list[int] = []
    argmax = backend._argmax

    def record(ctx, row):  # noqa: ANN001, ANN202 - records the single slot's greedy choices
        tokens.append(argmax(ctx, row))
        return tokens[-1]

    backend._argmax = record
    backend.run(reqs[:1], 1)
    ref = backend.llm.create_completion(reqs[0].prompt_token_ids, max_tokens=reqs[0].output_len, temperature=0.0,
                                        logit_bias={backend.eos: -1e9})
    ours = backend.llm.detokenize(tokens).decode(errors="replace")
    text_ok = ours == ref["choices"][0]["text"]
    print(f"token counts per request: {'ok' if counts_ok else 'MISMATCH'}")
    print(f"slot decode vs create_completion: {'ok' if text_ok else 'MISMATCH'} ({ours!r})")
    return 0 if counts_ok and text_ok else 1


if __name__ == "__main__":
    sys.exit(main())
