"""What EAGLE costs when the fallback keeps speculation off: CPU seconds (and wall seconds) per
output token of greedy chat turns (the ``chat-text`` workload), without speculation and with an
EAGLE head (fallback on, the default), one request at a time, the two engines interleaved (the
order alternating), medians. CPU time (``time.process_time``, one thread) is what a request
costs the machine, far less moved than wall time by other jobs on a shared host.

    PYTHONPATH=$PWD python benchmarks/eagle_off_cost_cpu.py --model smollm2-135m-instruct \
        --head HEAD_DIR --prompts 8 --output-len 128 --threads 1

Run it on two checkouts (before / after a change) for the same figures; it prints the EAGLE
proposer's ``ProposerWork`` (rows and forward calls its layer ran) where the proposer has one.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from treadle import LLM, SamplingParams
from treadle.bench.workloads import LengthRange, WorkloadSpec, chat_text_workload
from treadle.loaders import open_model_source


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--head", required=True, help="an EAGLE head directory (treadle train-draft-head)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = WorkloadSpec("chat-text", num_prompts=args.prompts, output_len=LengthRange(args.output_len, args.output_len))
    requests = chat_text_workload(spec, open_model_source(args.model).tokenizer)
    max_len = max(r.prompt_len for r in requests) + args.output_len + 16
    eagle = {"method": "eagle", "model": args.head, "num_speculative_tokens": args.k}
    llms = {"nospec": LLM(args.model, max_model_len=max_len),
            "eagle": LLM(args.model, max_model_len=max_len, speculative_config=eagle)}
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for llm in llms.values():  # warm-up
        llm.generate({"prompt_token_ids": requests[0].prompt_token_ids}, params, use_tqdm=False)
    cpu: dict[str, list[float]] = {name: [] for name in llms}
    wall: dict[str, list[float]] = {name: [] for name in llms}
    for i, req in enumerate(requests):
        for name in (list(llms) if i % 2 == 0 else list(llms)[::-1]):
            c, w = time.process_time(), time.perf_counter()
            out = llms[name].generate({"prompt_token_ids": req.prompt_token_ids}, params, use_tqdm=False)[0]
            n = len(out.outputs[0].token_ids)
            cpu[name].append((time.process_time() - c) / n * 1e3)
            wall[name].append((time.perf_counter() - w) / n * 1e3)
    ratio = statistics.median(e / p for e, p in zip(cpu["eagle"], cpu["nospec"]))
    print(f"{len(requests)} chat-text turns, {args.output_len} tokens each, greedy; ms per output token, "
          "median (min-max)")
    for name in llms:
        print(f"  {name:7s} cpu {statistics.median(cpu[name]):7.2f} ({min(cpu[name]):.2f}-{max(cpu[name]):.2f})"
              f"  wall {statistics.median(wall[name]):7.2f} ({min(wall[name]):.2f}-{max(wall[name]):.2f})")
    print(f"  eagle / nospec, CPU time per token: median of per-turn ratios {ratio:.3f}")
    stats = llms["eagle"].get_stats()["spec_decode"]
    print(f"  eagle: {stats['drafts']} verifies, mean acceptance length {stats['mean_acceptance_length']}, "
          f"fallbacks batch {stats['batch_fallbacks']} request {stats['request_fallbacks']}, probes {stats['probes']}")
    proposer = llms["eagle"].engine.model_runner().proposer
    work = getattr(proposer, "work", None)
    if work is not None:
        print(f"  eagle layer: {work.rows} rows in {work.forwards} forward calls")


if __name__ == "__main__":
    main()
