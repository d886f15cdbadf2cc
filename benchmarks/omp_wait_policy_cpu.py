"""The decode step beside other busy processes, with OpenMP's default wait policy (libgomp spins,
then sleeps) and with ``OMP_WAIT_POLICY=passive`` (it sleeps at once): SmolLM2-135M Q4_1, 8-bit
activations, 4 sequences of 64 prompt tokens, 32 new tokens each, through the offline API.

    .venv/bin/python benchmarks/omp_wait_policy_cpu.py [--busy 0 1 2] [--threads 2] [--rounds 2]

For each number of busy processes (pure-Python loops, one core each) the two policies alternate
``--rounds`` times, each in a fresh process (libgomp reads the variable when it loads); printed:
ms per step (the generate call's time over its 32 steps, prompt included), median, and
passive / default (below 1: passive faster).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

CHILD = """
import sys, time
from treadle import LLM, SamplingParams
llm = LLM("smollm2-135m-instruct", max_model_len=512)
ids = [(i * 7919) % 30000 + 100 for i in range(64)]
sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
llm.generate([{"prompt_token_ids": ids}] * 4, sp, use_tqdm=False)
t = time.perf_counter()
llm.generate([{"prompt_token_ids": ids}] * 4, sp, use_tqdm=False)
print((time.perf_counter() - t) / 32 * 1e3)
"""


def step_ms(policy: str | None, threads: int) -> float:
    env = {**os.environ, "TREADLE_ACTIVATION_BITS": "8", "OMP_NUM_THREADS": str(threads)}
    env.pop("OMP_WAIT_POLICY", None)
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600, check=True)
    return float(out.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--busy", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"machine: {cpu}, {os.cpu_count()} logical CPUs, load average {os.getloadavg()[0]:.1f} at the start")
    print("| busy processes | default ms/step | passive ms/step | passive / default |\n|---|---|---|---|")
    for busy in args.busy:
        burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            times: dict[str, list[float]] = {"default": [], "passive": []}
            for _ in range(args.rounds):
                times["default"].append(step_ms(None, args.threads))
                times["passive"].append(step_ms("passive", args.threads))
        finally:
            for b in burners:
                b.kill()
                b.wait()
        d, p = statistics.median(times["default"]), statistics.median(times["passive"])
        print(f"| {busy} | {d:.1f} | {p:.1f} | {p / d:.2f} |", flush=True)


if __name__ == "__main__":
    main()
