"""The most continuous batching can gain over the `static` peer on a workload, given a decode step's
cost as a function of its batch size.

`treadle bench throughput --backends treadle,static` compares continuous batching with static batches
that drop a finished request from the step (`treadle/bench/backends.py`): the static run does no
wasted work, it only runs some steps with fewer rows. So its ratio is bounded by how much cheaper a
full step is per row than a part-full one, and by the workload: with few requests per slot, the
continuous run drains too. This replays the workload's own lengths (the same seeded generator as
the bench) through both admission rules, counting decode steps weighted by the step cost, and prints
the ratio. Prefill costs the same in both runs, so the real ratio is lower still.

    python benchmarks/static_bound.py --input-len 32:512 --output-len 16:256 --num-prompts 32 \
        --concurrency 16 --step-ratio 4:1.38 16:3.3

`--step-ratio B:R` is a measured step cost at batch B relative to batch 1 (linear between the points,
flat past the last); with none given it prints a table over flat and linear-growth costs.
"""
from __future__ import annotations

import argparse

import numpy as np

from treadle.bench.workloads import LengthRange, WorkloadSpec, make_workload


def step_cost(points: list[tuple[int, float]]) -> list[float]:
    """cost[b] for b = 0..max, linear between the measured (batch, ratio) points."""
    pts = sorted({1: 1.0, **dict(points)}.items())
    bs, rs = [b for b, _ in pts], [r for _, r in pts]
    return [0.0] + [float(np.interp(b, bs, rs)) for b in range(1, max(bs) + 1)]


def times(outputs: list[int], concurrency: int, cost: list[float]) -> tuple[float, float]:
    """(static, continuous) decode time in batch-1 steps (``cost[b]``, flat past its end; cost[0] = 0)."""
    def f(b: int) -> float:
        return cost[min(b, len(cost) - 1)]

    static = 0.0
    for i in range(0, len(outputs), concurrency):
        batch = np.array(outputs[i:i + concurrency])
        static += sum(f(int((batch > t).sum())) for t in range(int(batch.max())))
    pending, live, cont = list(outputs), [], 0.0
    while pending or live:
        while pending and len(live) < concurrency:
            live.append(pending.pop(0))
        cont += f(len(live))
        live = [n - 1 for n in live if n > 1]
    return static, cont


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="random", choices=("random", "chat", "fixed"))
    p.add_argument("--input-len", default="32:512")
    p.add_argument("--output-len", default="16:256")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--step-ratio", nargs="*", default=[], metavar="B:R",
                   help="measured step cost at batch B / batch 1 (e.g. 4:1.38 16:3.3)")
    args = p.parse_args()
    spec = WorkloadSpec(args.workload, args.num_prompts, LengthRange.parse(args.input_len),
                        LengthRange.parse(args.output_len), seed=args.workload_seed)
    outputs = [r.output_len for r in make_workload(spec, vocab_size=1000)]
    c = args.concurrency
    print(f"{spec.describe()}, concurrency {c}: outputs mean {np.mean(outputs):.0f}, max {max(outputs)}")
    if args.step_ratio:
        curves = {" ".join(args.step_ratio): [(int(b), float(r)) for b, r in (s.split(":") for s in args.step_ratio)]}
    else:
        curves = {f"batch {c} = {r:g}x batch 1": [(c, r)] for r in (1.0, 1.3, 2.0, 3.0, float(c))}
    print("| step cost | static / continuous decode time (the ratio's ceiling) |\n|---|---|")
    for name, pts in curves.items():
        s, k = times(outputs, c, step_cost(pts))
        print(f"| {name} | {s / k:.2f}x |")


if __name__ == "__main__":
    main()
