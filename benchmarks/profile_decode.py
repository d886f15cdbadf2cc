"""Where a decode step's time goes: scheduling, input preparation, model (attention
separately), sampling, and output processing (detokenization, Python).

    .venv/bin/python benchmarks/profile_decode.py --model smollm2-135m-instruct --batch 1 --steps 64
    .venv/bin/python benchmarks/profile_decode.py ... --module-path   # layers module by module

The script drives the engine's own pieces in the order ``LLMEngine.step`` does, with a
timer around each; attention is timed by wrapping the model's attention backend.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from treadle import LLM, SamplingParams
from treadle.core.request import RequestStatus
from treadle.core.step_data import ModelRunnerOutput
from treadle.models.llama import LlamaAttention


class TimedBackend:
    """Wraps an attention backend and adds up the time spent in it."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner, self.name, self.seconds = inner, inner.name, 0.0

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        t = time.perf_counter()
        out = self.inner.forward(*args, **kwargs)
        self.seconds += time.perf_counter() - t
        return out


PARTS = ("schedule", "prepare", "model", "attention", "sample", "update", "output", "step")


def time_decode_step(eng, timed: TimedBackend, clock=time.perf_counter) -> tuple[float, ...]:  # noqa: ANN001
    """One engine step, as LLMEngine.step runs it, with a timer around each part (seconds, in PARTS order)."""
    runner = eng.model_runner()
    timed.seconds = 0.0
    t0 = clock()
    sched = eng.scheduler.schedule()
    t1 = clock()
    runner._update_states(sched)
    batch = runner._prepare(sched)
    t2 = clock()
    with torch.inference_mode():
        hidden = runner.forward(batch)
        index = torch.tensor([i for _, i in batch.sample_rows])
        logits = runner.model.compute_logits(hidden.index_select(0, index))
    t3 = clock()
    states = [runner.requests[rid] for rid, _ in batch.sample_rows]
    tokens, _ = runner.sampler(logits, [s.sampling_row() for s in states])
    result = ModelRunnerOutput(sampled={})
    for state, tok in zip(states, tokens):
        state.output_token_ids.append(tok)
        result.sampled[state.data.request_id] = [tok]
    t4 = clock()
    touched = eng.scheduler.update_from_output(sched, result)
    t5 = clock()
    updated = eng.outputs.process(touched, result, lambda r: eng.scheduler.finish(r, RequestStatus.FINISHED_STOPPED))
    for pid in updated:
        eng.outputs.make_output(pid)
    t6 = clock()
    return (t1 - t0, t2 - t1, t3 - t2 - timed.seconds, timed.seconds, t4 - t3, t5 - t4, t6 - t5, t6 - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the process's CPU time (all threads together), steadier on a shared machine")
    ap.add_argument("--module-path", action="store_true",
                    help="run decoder layers module by module (no one-call C layer), so attention is timed apart")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, quantization=args.quantization, dtype=args.dtype, kv_cache_memory="512MiB",
              fused_layers=not args.module_path)
    eng = llm.engine
    runner = eng.model_runner()
    timed = TimedBackend(runner.backend)
    for module in runner.model.modules():
        if isinstance(module, LlamaAttention):  # the module path's attention calls (fused layers make none)
            module.backend = timed
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
    for i in range(args.batch):
        eng.add_request(str(i), {"prompt_token_ids": [100 + (i + j) % 1000 for j in range(args.prompt_len)]}, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
        eng.step()  # prefill
    parts: dict[str, list[float]] = {k: [] for k in PARTS}
    for _ in range(args.steps):
        clock = time.process_time if args.clock == "cpu" else time.perf_counter
        for k, v in zip(PARTS, time_decode_step(eng, timed, clock)):
            parts[k].append(v)
    step = statistics.median(parts["step"])
    print(f"model {args.model} quantization {args.quantization} dtype {args.dtype} batch {args.batch} "
          f"threads {torch.get_num_threads()} clock {args.clock}: median step {step * 1e3:.2f} ms = {args.batch / step:.1f} tok/s")
    print(f"{'part':<12}{'median ms':>10}{'share':>8}")
    for k in PARTS[:-1]:
        m = statistics.median(parts[k])
        print(f"{k:<12}{m * 1e3:>10.3f}{m / step:>8.1%}")
    if statistics.median(parts["attention"]) == 0.0:
        print("(attention ran inside the one-call C decoder layers: it is part of 'model'; --module-path times it apart)")


if __name__ == "__main__":
    main()
