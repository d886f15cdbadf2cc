"""A discrete-event simulation of the waiting-queue policies on the ablation's workload, to
choose the ``predicted`` policy's bounds (docs/scheduling.md, "The count bound") without hours
of serving runs. Not the engine: a model of it.

The requests are the ``lengths`` workload's held-out prompts as ``treadle bench serve`` draws
them (same mix, same draws per salt), each with its true greedy length and its prediction from
the shipped predictor's ``lengths.jsonl``; Poisson arrivals. ``--slots`` sequences run at once;
a step costs ``base + per_seq * (running - 1) + per_prompt_token * prefill tokens`` seconds
(two cost models by default, fitted to the engine's decode step and the server's measured
throughput); prompt chunks of up to 512 tokens. Each policy's ratios to fcfs (median, mean,
p99 worse, median TTFT) are medians over the arrival draws; ``[max]`` is the worst p99 draw.

    python benchmarks/scheduling_sim.py --draws 12 --rate 3

``--instances K``: K such engines behind a router (``--slots`` each), two ways: a queue per
instance, each request sent at arrival to the instance with the fewest running + waiting requests
(``treadle router --balance count``), or the router's dispatch queue (``--queue``): one waiting
list, a request admitted by whichever instance frees a slot first. Adds output throughput
(tokens over the makespan) to the ratios.

    python benchmarks/scheduling_sim.py --draws 12 --rate 4.5 --instances 2
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import numpy as np

from treadle.bench.workloads import LENGTH_MIX
from treadle.core.cost_policy import PREFILL_TOKEN_COST
from treadle.predict.model import shipped_for

COSTS = {"fast": (0.016, 0.0025, 0.0022), "slow": (0.022, 0.003, 0.0022)}  # base, per seq, per prompt token (s)
Key = Callable[[dict], tuple]


def workload(rows: list[dict], n: int, salt: int, rate: float, seed: int = 0) -> list[dict]:
    by_kind = {k: [r for r in rows if r.get("split") == "heldout" and r.get("kind") == k] for k in LENGTH_MIX}
    rng = np.random.default_rng([seed, salt])
    kinds = rng.choice(list(LENGTH_MIX), size=n, p=list(LENGTH_MIX.values()))
    decks = {k: [int(i) for i in rng.permutation(len(v))] for k, v in by_kind.items()}
    taken = dict.fromkeys(LENGTH_MIX, 0)
    gaps = np.random.default_rng([seed, salt, 1]).exponential(1.0 / rate, size=n)
    reqs = []
    for kind, arrival in zip(kinds.tolist(), np.cumsum(gaps).tolist()):
        row = by_kind[kind][decks[kind][taken[kind] % len(decks[kind])]]
        taken[kind] += 1
        reqs.append({"p": len(row["prompt_token_ids"]), "L": max(1, min(row["length"], 256)),
                     "pred": max(1, min(row["predicted"], 256)), "arr": arrival})
    return reqs


def simulate(reqs: list[dict], key: Key, cap: int | None, slots: int, cost: tuple[float, float, float]) -> dict:
    reqs = [dict(r, gen=0, todo=r["p"], passed=0) for r in reqs]
    pending, waiting, running, t, i = sorted(reqs, key=lambda r: r["arr"]), [], [], 0.0, 0
    while i < len(pending) or waiting or running:
        while i < len(pending) and pending[i]["arr"] <= t:
            waiting.append(pending[i])
            i += 1
        if not waiting and not running:
            t = pending[i]["arr"]
            continue
        while len(running) < slots and waiting:
            overdue = [w for w in waiting if cap is not None and w["passed"] >= cap]
            r = min(overdue, key=lambda w: w["arr"]) if overdue else min(waiting, key=key)
            waiting.remove(r)
            for w in waiting:
                w["passed"] += w["arr"] < r["arr"]
            r["start"] = t
            running.append(r)
        budget = 512
        t += cost[0] + cost[1] * (len(running) - 1) + cost[2] * min(budget, sum(r["todo"] for r in running))
        for r in running:
            if r["todo"]:
                take = min(r["todo"], budget)
                r["todo"] -= take
                budget -= take
                if not r["todo"]:
                    r["gen"], r["first"] = 1, t
            else:
                r["gen"] += 1
        for r in [r for r in running if not r["todo"] and r["gen"] >= r["L"]]:
            r["done"] = t
            running.remove(r)
    e2e = [r["done"] - r["arr"] for r in reqs]
    return {"med": statistics.median(e2e), "mean": statistics.mean(e2e), "p99": float(np.percentile(e2e, 99)),
            "ttft": statistics.median(r["first"] - r["arr"] for r in reqs)}


def simulate_router(reqs: list[dict], key: Key, cap: int | None, slots: int, cost: tuple[float, float, float],
                    instances: int, pooled: bool) -> dict:
    """``instances`` engines, each stepping on its own clock; arrivals up to the stepping
    instance's clock are routed first (to the shared list, or to the instance with the fewest
    running + waiting requests). The same step and admission rules as ``simulate``."""
    reqs = [dict(r, gen=0, todo=r["p"], passed=0) for r in reqs]
    pending = sorted(reqs, key=lambda r: r["arr"])
    engines = [{"t": 0.0, "running": [], "waiting": []} for _ in range(instances)]
    shared: list[dict] = []
    i, turn = 0, 0
    while True:
        e = min(engines, key=lambda e: e["t"])
        t = e["t"]
        while i < len(pending) and pending[i]["arr"] <= t:
            r = pending[i]
            i += 1
            if pooled:
                shared.append(r)
            else:
                turn += 1
                n = len(engines)
                dest = min(range(n), key=lambda k: (len(engines[k]["running"]) + len(engines[k]["waiting"]),
                                                   (k - turn) % n))
                engines[dest]["waiting"].append(r)
        waiting = shared if pooled else e["waiting"]
        if not e["running"] and not waiting:  # idle until the next arrival; done when none is left
            e["t"] = pending[i]["arr"] if i < len(pending) else float("inf")
            if all(x["t"] == float("inf") for x in engines):
                break
            continue
        while len(e["running"]) < slots and waiting:
            overdue = [w for w in waiting if cap is not None and w["passed"] >= cap]
            r = min(overdue, key=lambda w: w["arr"]) if overdue else min(waiting, key=key)
            waiting.remove(r)
            for w in waiting:
                w["passed"] += w["arr"] < r["arr"]
            e["running"].append(r)
        budget = 512
        run = e["running"]
        t += cost[0] + cost[1] * (len(run) - 1) + cost[2] * min(budget, sum(r["todo"] for r in run))
        for r in run:
            if r["todo"]:
                take = min(r["todo"], budget)
                r["todo"] -= take
                budget -= take
                if not r["todo"]:
                    r["gen"], r["first"] = 1, t
            else:
                r["gen"] += 1
        for r in [r for r in run if not r["todo"] and r["gen"] >= r["L"]]:
            r["done"] = t
            run.remove(r)
        e["t"] = t
    e2e = [r["done"] - r["arr"] for r in reqs]
    makespan = max(r["done"] for r in reqs) - min(r["arr"] for r in reqs)
    return {"med": statistics.median(e2e), "mean": statistics.mean(e2e), "p99": float(np.percentile(e2e, 99)),
            "ttft": statistics.median(r["first"] - r["arr"] for r in reqs), "tput": sum(r["L"] for r in reqs) / makespan}


def router_main(args: argparse.Namespace, rows: list[dict]) -> None:
    def aged(r: dict) -> tuple:
        c = PREFILL_TOKEN_COST * r["p"] + r["pred"]
        return (r["arr"] + args.aging_s * c / (c + 128), r["arr"])

    cases: dict[str, tuple[Key, int | None, bool]] = {
        "queue per instance, fcfs (count-fcfs)": (lambda r: (r["arr"],), None, False),
        "queue per instance, predicted + count 20 (count-predicted)": (aged, 20, False),
        "router queue, fcfs": (lambda r: (r["arr"],), None, True),
    }
    for cap in (20, 30, 40):
        cases[f"router queue, predicted + count {cap}"] = (aged, cap, True)
    for name, cost in COSTS.items():
        print(f"step cost model {name} {cost}, {args.instances} instances x {args.slots} slots, {args.rate} req/s, "
              f"{args.draws} draws")
        print("| case | median e2e | mean e2e | p99 (worse) [max] | median TTFT | throughput |\n|---|---|---|---|---|---|")
        draws = [workload(rows, args.num_prompts, s, args.rate) for s in range(1, args.draws + 1)]
        base = None
        for label, (key, cap, pooled) in cases.items():
            got = [simulate_router(d, key, cap, args.slots, cost, args.instances, pooled) for d in draws]
            base = base or got
            ratio = {m: [b[m] / g[m] for b, g in zip(base, got)] for m in ("med", "mean", "ttft")}
            worse = [g["p99"] / b["p99"] for b, g in zip(base, got)]
            tput = [g["tput"] / b["tput"] for b, g in zip(base, got)]
            print(f"| {label} | {statistics.median(ratio['med']):.2f}x | {statistics.median(ratio['mean']):.2f}x | "
                  f"{statistics.median(worse):.2f}x [{max(worse):.2f}] | {statistics.median(ratio['ttft']):.2f}x | "
                  f"{statistics.median(tput) - 1:+.1%} |")


def policies(aging_s: float) -> dict[str, tuple[Key, int | None]]:
    def cost(r: dict, length: str) -> float:
        return PREFILL_TOKEN_COST * r["p"] + r[length]

    def aged(r: dict) -> tuple:
        c = cost(r, "pred")
        return (r["arr"] + aging_s * c / (c + 128), r["arr"])

    out: dict[str, tuple[Key, int | None]] = {"oracle (true cost, no bound)": (lambda r: (cost(r, "L"), r["arr"]), None),
                                              "predicted, no bound": (lambda r: (cost(r, "pred"), r["arr"]), None),
                                              "aging 10 s": ((lambda r: (r["arr"] + 10 * cost(r, "pred") / (cost(r, "pred") + 128),)), None)}
    for cap in (12, 16, 20, 24):
        out[f"aging {aging_s:g} s + count {cap}"] = (aged, cap)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draws", type=int, default=12)
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--rate", type=float, default=3.0)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--aging-s", type=float, default=120.0)
    p.add_argument("--instances", type=int, default=1, help="above 1: instances behind a router (see above)")
    args = p.parse_args()
    rows = [json.loads(line) for line in open(shipped_for("smollm2-135m-instruct") / "lengths.jsonl")]
    if args.instances > 1:
        router_main(args, rows)
        return
    for name, cost in COSTS.items():
        print(f"step cost model {name} {cost}, {args.slots} slots, {args.rate} req/s, {args.draws} draws")
        print("| policy | median e2e | mean e2e | p99 (worse) [max] | median TTFT |\n|---|---|---|---|---|")
        draws = [workload(rows, args.num_prompts, s, args.rate) for s in range(1, args.draws + 1)]
        base = [simulate(d, lambda r: (r["arr"],), None, args.slots, cost) for d in draws]
        for label, (key, cap) in policies(args.aging_s).items():
            got = [simulate(d, key, cap, args.slots, cost) for d in draws]
            ratio = {m: [b[m] / g[m] for b, g in zip(base, got)] for m in ("med", "mean", "ttft")}
            worse = [g["p99"] / b["p99"] for b, g in zip(base, got)]
            print(f"| {label} | {statistics.median(ratio['med']):.2f}x | {statistics.median(ratio['mean']):.2f}x | "
                  f"{statistics.median(worse):.2f}x [{max(worse):.2f}] | {statistics.median(ratio['ttft']):.2f}x |")


if __name__ == "__main__":
    main()
