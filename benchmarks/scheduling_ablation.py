"""Issue 33's ablation: the same Poisson arrivals of the ``lengths`` workload served under
fcfs, predicted, an oracle order and a random order, each case repeated and the cases
interleaved (rep 1: fcfs, predicted, oracle, random; rep 2: ...), so drift of a shared machine
hits every case alike. Medians over the repeats, ratios against the first case (fcfs).
With ``--router``: two instances behind ``treadle router``, the same arrivals: count-balanced
instances scheduling fcfs (the baseline: what the router and engine did before), count-balanced
instances scheduling ``predicted``, cost-balanced (``--balance cost``) ``predicted`` instances, and
the router's own dispatch queue (``--queue predicted``: requests wait in the router for a free
batch slot and go shortest predicted job first; ``queue-fcfs``, in arrival order, is a case too).

Each run starts its own ``treadle serve`` (restarted between runs: no warm prefix cache or
queue carries over) and drives it with ``treadle bench serve``; oracle and random run the
server with ``--scheduling-policy priority`` and the client sends each request's true cost,
or a random rank, as its priority (``--ordering``).

    python benchmarks/scheduling_ablation.py --model smollm2-135m-instruct --num-prompts 60 \
        --request-rate 1.2 --repeats 3 --save-result /tmp/ablation.json
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

TREADLE = [sys.executable, "-m", "treadle.entrypoints.cli"]
CASES = {  # name: (server policy, client ordering)
    "fcfs": ("fcfs", "none"),
    "predicted": ("predicted", "none"),
    "oracle": ("priority", "oracle"),
    "random": ("priority", "random"),
}
ROUTER_CASES = {  # --router: name: (`treadle router --balance`, the instances' --scheduling-policy, --queue)
    "count-fcfs": ("count", "fcfs", "off"),
    "count-predicted": ("count", "predicted", "off"),
    "cost-predicted": ("cost", "predicted", "off"),
    "queue-predicted": ("cost", "predicted", "predicted"),
}
EXTRA_ROUTER_CASES = {"queue-fcfs": ("count", "fcfs", "fcfs")}  # only when asked for
ROWS = [("median e2e s", "e2el_ms", "median", 1e-3), ("mean e2e s", "e2el_ms", "mean", 1e-3),
        ("p99 e2e s", "e2el_ms", "p99", 1e-3), ("median TTFT s", "ttft_ms", "median", 1e-3),
        ("longest wait (max TTFT) s", "ttft_ms", "p100", 1e-3), ("output tok/s", "output_throughput", None, 1.0)]


def serve(args: argparse.Namespace, policy: str, port: int | None = None) -> subprocess.Popen:
    port = args.port if port is None else port
    cmd = [*TREADLE, "serve", args.model, "--port", str(port), "--max-num-seqs", str(args.max_num_seqs),
           "--threads", str(args.threads), "--scheduling-policy", policy, *args.serve_arg]
    return start(cmd, port)


def start(cmd: list[str], port: int) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{' '.join(cmd)} exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise SystemExit(f"{' '.join(cmd)} did not become healthy within 180 s")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def run_case(args: argparse.Namespace, name: str, out: Path) -> dict:
    if args.router:
        return run_router_case(args, name, out)
    policy, ordering = CASES[name]
    proc = serve(args, policy)
    try:
        return bench(args, ordering, out)
    finally:
        stop(proc)


def run_router_case(args: argparse.Namespace, name: str, out: Path) -> dict:
    """Two instances (ports port+1, port+2) behind ``treadle router`` on ``port``, balancing and
    instance policy as ROUTER_CASES[name] says."""
    balance, policy, queue = {**ROUTER_CASES, **EXTRA_ROUTER_CASES}[name]
    procs = [serve(args, policy, args.port + i) for i in (1, 2)]
    try:
        urls = [f"http://127.0.0.1:{args.port + i}" for i in (1, 2)]
        procs.append(start([*TREADLE, "router", "--backend", *urls, "--port", str(args.port),
                            "--balance", balance, "--no-prefix-affinity", "--queue", queue], args.port))
        return bench(args, "none", out)
    finally:
        for proc in reversed(procs):
            stop(proc)


def bench(args: argparse.Namespace, ordering: str, out: Path) -> dict:
    cmd = [*TREADLE, "bench", "serve", "--base-url", f"http://127.0.0.1:{args.port}", "--model", args.model,
           "--workload", "lengths", "--num-prompts", str(args.num_prompts), "--output-len", str(args.output_len),
           "--request-rate", str(args.request_rate), "--seed", str(args.seed), "--percentiles", "50,90,99,100",
           "--ordering", ordering, "--save-result", str(out), *args.bench_arg]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=args.timeout)
    return json.loads(out.read_text())["results"][0]["metrics"]


def value(metrics: dict, key: str, stat: str | None) -> float:
    m = metrics[key]
    if stat is None:
        return m
    return m[stat] if stat in ("mean", "median") else m["percentiles"][stat]


def table(runs: dict[str, list[dict]]) -> str:
    names = [n for n in runs if runs[n]]
    base = names[0]
    lines = ["| measure (median of repeats) | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for label, key, stat, scale in ROWS:
        meds = {n: statistics.median(value(m, key, stat) for m in runs[n]) * scale for n in names}
        cells = []
        for n in names:
            cell = f"{meds[n]:.2f}"
            if n != base and meds[n] > 0:
                ratio = meds[base] / meds[n] if key != "output_throughput" else meds[n] / meds[base]
                cell += f" ({ratio:.2f}×)"
            cells.append(cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--cases", default=None, help=f"comma list of {','.join(CASES)} (with --router: "
                   f"{','.join([*ROUTER_CASES, *EXTRA_ROUTER_CASES])}); ratios are against the first")
    p.add_argument("--router", action="store_true", help="two instances behind treadle router: count/fcfs vs "
                   "count/predicted vs cost/predicted")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--request-rate", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--port", type=int, default=8751)
    p.add_argument("--timeout", type=float, default=900, help="seconds one bench run may take")
    p.add_argument("--serve-arg", action="append", default=[], help="one more `treadle serve` argument")
    p.add_argument("--bench-arg", action="append", default=[], help="one more `treadle bench serve` argument")
    p.add_argument("--save-result", default=None, metavar="FILE.json")
    args = p.parse_args()
    cases = (args.cases or ",".join(ROUTER_CASES if args.router else CASES)).split(",")
    runs: dict[str, list[dict]] = {n: [] for n in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for name in cases:
                started = time.strftime("%H:%M:%S")
                m = run_case(args, name, Path(tmp) / f"{name}-{rep}.json")
                runs[name].append(m)
                print(f"rep {rep + 1} {name:9s} {started}: median e2e {m['e2el_ms']['median'] / 1e3:.2f} s, "
                      f"median TTFT {m['ttft_ms']['median'] / 1e3:.2f} s, {m['output_throughput']:.0f} tok/s",
                      flush=True)
    print(table(runs))
    if args.save_result:
        Path(args.save_result).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
