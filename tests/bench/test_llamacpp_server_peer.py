"""llama.cpp's own server as the peer (treadle/bench/llamacpp_server.py), run for real on the
SmolLM2-135M Q4_1 GGUF. The binary comes from tools/build_llamacpp.sh (built from source, cached);
where it is not built these tests skip, naming that command."""
from __future__ import annotations

import pytest

from treadle.bench.llamacpp_server import LlamaServerBackend, greedy_logprobs, llamacpp_bin_dir
from treadle.bench.workloads import BenchRequest

pytestmark = [pytest.mark.server, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
PROMPTS = ["Once upon a time, there was a little", "The capital of France is", "def fibonacci(n):"]
NEW_TOKENS = 16
# ggml's AMX matmul (chosen on this AMX CPU when weights may be repacked) dies with SIGILL at its
# first tile instruction on the project's VM; these tests check results and plumbing, not speed
NO_AMX = ("--no-repack",)


@pytest.fixture(scope="module")
def gguf():  # noqa: ANN201
    from treadle.loaders.resolve import resolve_model

    try:
        llamacpp_bin_dir()
    except RuntimeError as e:  # the message names tools/build_llamacpp.sh
        pytest.skip(str(e))
    return resolve_model(MODEL)


def test_greedy_tokens_match_treadle_up_to_a_near_tie(gguf) -> None:  # noqa: ANN001
    """llama.cpp (8-bit activations, f16 KV) and Treadle on the same file give the same greedy
    tokens; they may part only where llama.cpp's top two logits are within 0.5, and on the
    shared prefix the chosen tokens' logprobs agree closely."""
    from treadle import LLM, SamplingParams

    llm = LLM(MODEL, max_model_len=256)
    tok = llm.get_tokenizer()
    ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    theirs = greedy_logprobs(gguf, ids, max_tokens=NEW_TOKENS, top_n=2, ignore_eos=True, extra_args=NO_AMX)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    ours = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    diffs = []
    for run, out in zip(theirs, ours):
        assert len(run.tokens) == NEW_TOKENS
        assert all(top[0][0] == t for top, t in zip(run.top, run.tokens))  # greedy: its own argmax
        mine = out.outputs[0]
        for step, (t_theirs, t_mine) in enumerate(zip(run.tokens, mine.token_ids)):
            if t_theirs != t_mine:
                margin = run.top[step][0][1] - run.top[step][1][1]
                assert margin < 0.5, f"diverged at step {step} where llama.cpp's margin is {margin:.3f}"
                break
            diffs.append(abs(mine.logprobs[step][t_mine].logprob - run.logprobs[step]))
    assert len(diffs) >= NEW_TOKENS  # at least one prompt's worth of shared steps
    assert sum(diffs) / len(diffs) <= 0.1


def test_bench_backend_serves_a_ragged_workload_with_one_slot_per_request(gguf) -> None:  # noqa: ANN001
    """The bench backend starts llama-server with -np = the concurrency, every request gets
    exactly its output length through the OpenAI stream, and close() ends the process."""
    lengths = [(12, 5), (40, 9), (7, 3), (25, 12), (60, 4), (18, 7)]
    reqs = [BenchRequest(list(range(100 + i, 100 + i + p)), o) for i, (p, o) in enumerate(lengths)]
    backend = LlamaServerBackend(gguf, n_ctx=96, threads=2, extra_args=NO_AMX)
    try:
        result = backend.run(reqs, concurrency=3)
        server = backend.server
        assert server is not None and server.command[server.command.index("-np") + 1] == "3"
        assert [r.num_output_tokens for r in result.records] == [o for _, o in lengths]
        assert all(r.success and r.ttft > 0 for r in result.records)
        assert backend.run(reqs[:2], concurrency=3).records  # the same server serves a second run
        assert backend.server is server
    finally:
        backend.close()
    assert server.proc.poll() is not None

