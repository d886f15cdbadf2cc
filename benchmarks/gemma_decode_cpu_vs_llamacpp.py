"""Gemma 3 270M (Q4_K_M, the same file) batch-1 decode after a 512-token context, one thread,
Treadle against llama.cpp in CPU time per token: on a shared, busy machine wall time mostly
measures the other jobs, CPU time much less so.

    tools/build_llamacpp.sh                                                # once (cached)
    .venv/bin/python benchmarks/gemma_decode_cpu_vs_llamacpp.py --rounds 3

llama.cpp: process CPU time (user + sys) of ``llama-bench -m FILE -t 1 -p 0 -n N -d 512 -r 1
--repack 0`` for N = 33 and N = 1, the difference over 32 tokens (model load, context fill and
warm-up cancel out). Treadle: ``benchmarks/fused_stack_ab.py --context 512 --steps 16 --threads 1``,
the thread CPU time of each engine step (scheduling and sampling included), the fused C stack and
the module path interleaved. Rounds alternate the engines; each round's ratio is llama.cpp's CPU
per token over Treadle's (above 1: Treadle faster).
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child_cpu(cmd: list[str]) -> tuple[float, str]:
    """(user + sys seconds of the command's process tree, its stdout)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), proc.stdout


def llama_ms(bench: str, model: str) -> float:
    def cpu(n: int) -> float:
        return child_cpu([bench, "-m", model, "-t", "1", "-p", "0", "-n", str(n), "-d", "512", "-r", "1",
                          "--repack", "0"])[0]
    return (cpu(33) - cpu(1)) / 32 * 1e3


def treadle_ms() -> dict[str, float]:
    _, out = child_cpu([sys.executable, str(ROOT / "benchmarks" / "fused_stack_ab.py"), "--model", "gemma-3-270m",
                        "--context", "512", "--steps", "16", "--threads", "1"])
    return {line.split()[0]: float(line.split()[2]) for line in out.splitlines() if " step:" in line}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from treadle.bench.llamacpp_server import llamacpp_bin_dir
    from treadle.loaders.resolve import resolve_model

    bench, model = str(llamacpp_bin_dir() / "llama-bench"), str(resolve_model("gemma-3-270m"))
    print(f"TREADLE_ACTIVATION_BITS={os.environ.get('TREADLE_ACTIVATION_BITS', '16 (default)')}")
    ratios, rows = [], []
    for r in range(args.rounds):
        llama, treadle = llama_ms(bench, model), treadle_ms()
        ratios.append(llama / treadle["fused"])
        rows.append((llama, treadle["fused"], treadle["module"]))
        print(f"round {r}: llama.cpp {llama:.1f} ms/token, Treadle fused {treadle['fused']:.1f} ms/step "
              f"(module path {treadle['module']:.1f}), llama.cpp / Treadle {ratios[-1]:.2f}", flush=True)
    med = [statistics.median(c) for c in zip(*rows)]
    print(f"medians: llama.cpp {med[0]:.1f}, Treadle fused {med[1]:.1f}, module path {med[2]:.1f} ms CPU; "
          f"ratio {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
