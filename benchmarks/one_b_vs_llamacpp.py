"""The 1.1B-class model (issue 32 item 3), Treadle against llama.cpp on the very same GGUF files
(tools/make_1b_model.py: TinyLlama's shape, random weights, quantized by llama.cpp's own
llama-quantize): batch-1 decode after a 512-token prompt, the 512-token prompt, the decode step
against the read-bandwidth floor, resident memory, and (``--batch16``) the batch-16 decode step.

    tools/build_llamacpp.sh && .venv/bin/python tools/make_1b_model.py     # once (cached)
    .venv/bin/python benchmarks/one_b_vs_llamacpp.py [--quants Q4_K_M Q4_0] [--threads 1 2] \\
        [--rounds 3] [--batch16] [--activation-bits 16 8]

Rounds are interleaved (each round runs every quant x thread count, llama.cpp then Treadle, one
after the other), and each ratio is taken within its round (Treadle / llama.cpp, above 1: Treadle
faster); the table gives the median ratio and its range over the rounds. The commands it runs:

    llama-bench -m FILE -t T -p 512 -n 0 -r 1 --repack 0 -o json          (512-token prompt)
    llama-bench -m FILE -t T -p 0 -n 32 -d 512 -r 1 --repack 0 -o json    (decode after 512 tokens)
    treadle bench latency --model FILE --backends treadle --input-len 512 --output-len 32 --iters 1 \\
        --threads T --max-model-len 1024                                   (both, one request)
    --batch16:  treadle bench throughput --model FILE --backends treadle --workload fixed --input-len 64 \\
        --output-len 32 --num-prompts 16 --concurrency 16 --threads T --max-model-len 256   (TPOT p50)
                llama-batched-bench -m FILE -t T -c 2048 -npp 64 -ntg 32 -npl 16 --no-repack   (T_TG / 32)

``--repack 0`` / ``--no-repack``: ggml's AMX matmul dies with SIGILL on the VM this was written
on (docs/models.md); it also turns off ggml's repacked AVX-512 / AVX2 paths (Q4_0, Q4_K), which
handicaps the peer. ``--repack`` drops those flags: for a llama.cpp built without AMX
(``NO_AMX=1 tools/build_llamacpp.sh``, then ``TREADLE_LLAMACPP_BIN`` = the folder it prints). The floor: the file's
bytes over ``treadle doctor``'s read bandwidth at T threads (taken once per thread count, before
the rounds), and "of floor" is that time over Treadle's decode step. Resident memory: a fresh
process's VmRSS after ``LLM(FILE)`` (16 KV blocks) minus its VmRSS with treadle imported.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREADLE = [str(ROOT / ".venv" / "bin" / "treadle")]
RSS_SCRIPT = """
import sys
from treadle import LLM
def rss():
    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmRSS')) * 1024
before = rss()
llm = LLM(sys.argv[1], max_model_len=256, num_kv_blocks=16)
print(rss() - before)
"""


def run(cmd: list[str], env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return proc.stdout


def llama_bin(name: str) -> str:
    from treadle.bench.llamacpp_server import llamacpp_bin_dir

    return str(llamacpp_bin_dir() / name)


def llama_tok_s(path: Path, threads: int, args: list[str], repack: bool) -> float:
    out = run([llama_bin("llama-bench"), "-m", str(path), "-t", str(threads), *args, "-r", "1",
               *([] if repack else ["--repack", "0"]), "-o", "json"])
    return float(json.loads(out)[0]["avg_ts"])


def treadle_latency(path: Path, threads: int, bits: int) -> tuple[float, float]:
    """(prompt tok/s, decode ms a token) of one 512-token request."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "r.json"
        run([*TREADLE, "bench", "latency", "--model", str(path), "--backends", "treadle", "--input-len", "512",
             "--output-len", "32", "--iters", "1", "--threads", str(threads), "--max-model-len", "1024",
             "--save-result", str(result)], {"TREADLE_ACTIVATION_BITS": str(bits)})
        row = json.loads(result.read_text())["rows"][0]
    return row["prompt_tok_s"]["median"], row["tpot_ms"]["median"]


def treadle_batch16_ms(path: Path, threads: int, bits: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "r.json"
        run([*TREADLE, "bench", "throughput", "--model", str(path), "--backends", "treadle", "--workload", "fixed",
             "--input-len", "64", "--output-len", "32", "--num-prompts", "16", "--concurrency", "16", "--threads",
             str(threads), "--max-model-len", "256", "--save-result", str(result)], {"TREADLE_ACTIVATION_BITS": str(bits)})
        runs = json.loads(result.read_text())["runs"]
    return statistics.median(r["metrics"]["tpot_ms"]["percentiles"]["p50"] for r in runs)


def llama_batch16_ms(path: Path, threads: int, repack: bool) -> float:
    out = run([llama_bin("llama-batched-bench"), "-m", str(path), "-t", str(threads), "-c", "2048", "-npp", "64",
               "-ntg", "32", "-npl", "16", *([] if repack else ["--no-repack"])])
    for line in out.splitlines():  # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[0] == "64" and cells[2] == "16":
            return float(cells[6]) / 32 * 1e3
    sys.exit(f"llama-batched-bench printed no batch-16 row:\n{out[-2000:]}")


def read_bandwidth(threads: int) -> float:
    out = run([*TREADLE, "doctor", "--no-decode", "--threads", str(threads), "--json"])
    return float(json.loads(out)["machine"]["read_bandwidth_gb_s"]) * 1e9


def resident_bytes(path: Path) -> int:
    return int(run([sys.executable, "-c", RSS_SCRIPT, str(path)]).split()[-1])


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    med = fmt.format(statistics.median(values))
    return med if len(values) == 1 else f"{med} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def machine_report(files: dict[str, Path], threads: list[int], repack: bool, rss: bool) -> dict[int, float]:
    """Print the machine, the peer, the read bandwidth per thread count (returned, bytes/s) and,
    with ``rss``, each file's resident growth after load."""
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"machine: {cpu}, {os.cpu_count()} logical CPUs, load average {os.getloadavg()[0]:.1f} at the start")
    print(f"llama.cpp: {llama_bin('')} ({'weights repacked' if repack else '--repack 0'})")
    bandwidth = {t: read_bandwidth(t) for t in threads}
    print("read bandwidth (treadle doctor): " + ", ".join(f"{bandwidth[t] / 1e9:.1f} GB/s at {t} threads" for t in threads))
    for q, path in files.items() if rss else ():
        grown = resident_bytes(path)
        print(f"{q}: file {path.stat().st_size / 2**20:.0f} MiB, Treadle's resident growth after load "
              f"{grown / 2**20:.0f} MiB ({grown / path.stat().st_size:.3f}x the file)")
    return bandwidth


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=None, help="the model folder (default: make_1b_model.py's)")
    ap.add_argument("--quants", nargs="+", default=["Q4_K_M", "Q4_0"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--activation-bits", type=int, nargs="+", default=[16], choices=[8, 16])
    ap.add_argument("--batch16", action="store_true", help="also the batch-16 decode step")
    ap.add_argument("--no-rss", action="store_true", help="skip the resident-memory check")
    ap.add_argument("--repack", action="store_true", help="llama.cpp repacks its weights (a build without AMX)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tools"))
    from make_1b_model import out_dir

    folder = args.dir or out_dir()
    files = {q: folder / f"{q}.gguf" for q in args.quants}
    for path in files.values():
        if not path.is_file():
            sys.exit(f"{path}: missing; run tools/build_llamacpp.sh and .venv/bin/python tools/make_1b_model.py")
    bandwidth = machine_report(files, args.threads, args.repack, not args.no_rss)
    keys = [(q, t, b) for q in args.quants for t in args.threads for b in args.activation_bits]
    got: dict[tuple, dict[str, list[float]]] = {k: {} for k in keys}
    for rnd in range(args.rounds):
        for q, t, b in keys:
            path, rec = files[q], got[(q, t, b)]
            lp = llama_tok_s(path, t, ["-p", "512", "-n", "0"], args.repack)
            ld = llama_tok_s(path, t, ["-p", "0", "-n", "32", "-d", "512"], args.repack)
            tp, tpot = treadle_latency(path, t, b)
            for name, v in (("llama prompt", lp), ("llama decode", ld), ("prompt", tp), ("tpot", tpot),
                            ("decode x", (1e3 / tpot) / ld), ("prompt x", tp / lp),
                            ("floor", path.stat().st_size / bandwidth[t] * 1e3 / tpot)):
                rec.setdefault(name, []).append(v)
            line = (f"round {rnd + 1} {q} T={t} a{b}: decode {1e3 / tpot:.2f} vs {ld:.2f} tok/s ({(1e3 / tpot) / ld:.2f}x), "
                    f"prompt {tp:.1f} vs {lp:.1f} tok/s ({tp / lp:.2f}x)")
            if args.batch16:
                tb, lb = treadle_batch16_ms(path, t, b), llama_batch16_ms(path, t, args.repack)
                rec.setdefault("b16", []).append(tb)
                rec.setdefault("llama b16", []).append(lb)
                rec.setdefault("b16 x", []).append(lb / tb)
                line += f", batch-16 step {tb:.0f} vs {lb:.0f} ms ({lb / tb:.2f}x)"
            print(line, flush=True)
    print("\n| file | threads | Treadle activations | batch-1 decode tok/s, Treadle / llama.cpp | ratio | "
          "decode / floor | 512-token prompt tok/s, Treadle / llama.cpp | ratio |"
          + (" batch-16 step ms, Treadle / llama.cpp | ratio |" if args.batch16 else ""))
    print("|---|---|---|---|---|---|---|---|" + ("---|---|" if args.batch16 else ""))
    for (q, t, b), rec in got.items():
        row = (f"| {q} | {t} | {b}-bit | {spread([1e3 / x for x in rec['tpot']])} / {spread(rec['llama decode'])} | "
               f"{spread(rec['decode x'])}x | {spread([100 * f for f in rec['floor']], '{:.0f}')} % | "
               f"{spread(rec['prompt'], '{:.1f}')} / {spread(rec['llama prompt'], '{:.1f}')} | {spread(rec['prompt x'])}x |")
        if args.batch16:
            row += f" {spread(rec['b16'], '{:.0f}')} / {spread(rec['llama b16'], '{:.0f}')} | {spread(rec['b16 x'])}x |"
        print(row)


if __name__ == "__main__":
    main()
