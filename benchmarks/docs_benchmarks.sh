#!/usr/bin/env bash
# Every figure in docs/benchmarks-archive.md, in the order the doc gives them.
# Runs sequentially (never two benchmarks at once); results land in $OUT.
#   bash benchmarks/docs_benchmarks.sh [step ...]    # steps: issue peers latency random serve q4 cpu kquant spec (default: all)
# Steps before `cpu` were measured when the engine's default was float weights: `treadle+none`
# reproduces that configuration now that a GGUF file runs natively by default.
set -euo pipefail
cd "$(dirname "$0")/.."
T=".venv/bin/treadle"
M=smollm2-135m-instruct
R=/tmp/treadle-bench/random-llama-150m
OUT=${OUT:-/tmp/treadle-bench/results}
mkdir -p "$OUT" docs/img
steps=${*:-issue peers latency random serve q4 cpu kquant spec}

# --threads 1: the docs machine had 2 cores shared with other jobs; with 2 threads torch's
# workers kept waiting on a descheduled sibling and every backend ran ~4x slower.
TH="--threads 1"
for step in $steps; do
  case $step in
  issue)  # continuous vs static batches on the engine issue's ragged workload, and KV waste at peak
    $T bench throughput --model $M --backends treadle,static --workload random --input-len 32:512 \
      --output-len 16:256 --num-prompts 16 --concurrency 8 --repeats 2 $TH \
      --save-result "$OUT/issue.json" 2>"$OUT/issue.err" | tee "$OUT/issue.txt" ;;
  peers)  # all four backends at concurrency 1, 4, 16; throughput chart and latency CDFs
    $T bench throughput --model $M --backends treadle,static,hf,llamacpp --workload random --input-len 32:256 \
      --output-len 8:32 --num-prompts 16 --concurrency 1,4,16 --repeats 1 $TH --plot docs/img/smollm2 \
      --save-result "$OUT/peers.json" 2>"$OUT/peers.err" | tee "$OUT/peers.txt" ;;
  latency)  # batch 1: TTFT, TPOT, roofline fractions
    $T bench latency --model $M --backends treadle,hf,llamacpp --input-len 256 --output-len 32 --iters 3 $TH \
      --save-result "$OUT/latency.json" 2>"$OUT/latency.err" | tee "$OUT/latency.txt" ;;
  random)  # a random ~150M Llama (HF directory, float32): Treadle, static, HF
    .venv/bin/python benchmarks/make_random_llama.py $R
    $T bench latency --model $R --backends treadle,hf --input-len 256 --output-len 32 --iters 3 $TH \
      --save-result "$OUT/random_latency.json" 2>"$OUT/random_latency.err" | tee "$OUT/random_latency.txt"
    $T bench throughput --model $R --backends treadle,static,hf --workload random --input-len 32:256 \
      --output-len 8:32 --num-prompts 16 --concurrency 16 --repeats 1 $TH \
      --save-result "$OUT/random.json" 2>"$OUT/random.err" | tee "$OUT/random.txt" ;;
  serve)  # the HTTP server: unlimited rate at concurrency 1/4/12, then Poisson arrivals; with goodput
    $T serve $M --port 8123 --log-level warning $TH >"$OUT/server.log" 2>&1 &
    srv=$!
    trap 'kill $srv 2>/dev/null || true' EXIT
    for _ in $(seq 120); do curl -sf http://127.0.0.1:8123/health >/dev/null && break; sleep 1; done
    $T bench serve --base-url treadle=http://127.0.0.1:8123 --model $M --workload random --input-len 32:256 \
      --output-len 8:32 --num-prompts 12 --max-concurrency 1,4,12 --goodput ttft:5000 tpot:500 \
      --plot docs/img/serve --save-result "$OUT/serve.json" 2>"$OUT/serve.err" | tee "$OUT/serve.txt"
    $T bench serve --base-url treadle=http://127.0.0.1:8123 --model $M --workload random --input-len 32:256 \
      --output-len 8:32 --num-prompts 12 --workload-seed 1 --request-rate 0.5 --goodput ttft:5000 tpot:500 \
      --save-result "$OUT/serve_poisson.json" 2>"$OUT/serve_poisson.err" | tee "$OUT/serve_poisson.txt"
    kill $srv; wait $srv 2>/dev/null || true; trap - EXIT ;;
  q4)  # Treadle with the GGUF's Q4_1 blocks kept native, against llama.cpp on the same bytes
    $T bench latency --model $M --backends treadle+none,treadle+gguf,llamacpp --input-len 256 --output-len 32 \
      --iters 3 $TH --save-result "$OUT/q4_latency.json" 2>"$OUT/q4_latency.err" | tee "$OUT/q4_latency.txt"
    $T bench throughput --model $M --backends treadle+none,treadle+gguf,llamacpp --workload random \
      --input-len 32:256 --output-len 8:32 --num-prompts 16 --concurrency 16 --repeats 1 $TH \
      --save-result "$OUT/q4_peers.json" 2>"$OUT/q4_peers.err" | tee "$OUT/q4_peers.txt" ;;
  cpu)  # the CPU speed issue: native Q4_1 on Treadle's C kernels vs llama.cpp vs HF, 2 threads
    $T bench latency --model $M --backends treadle,llamacpp,hf --input-len 512 --output-len 32 --iters 3 \
      --threads 2 --save-result "$OUT/cpu_latency.json" 2>"$OUT/cpu_latency.err" | tee "$OUT/cpu_latency.txt"
    $T bench throughput --model $M --backends treadle,llamacpp,hf --workload random --input-len 32:256 \
      --output-len 16:128 --num-prompts 64 --concurrency 32 --repeats 1 --threads 2 \
      --save-result "$OUT/cpu_c32.json" 2>"$OUT/cpu_c32.err" | tee "$OUT/cpu_c32.txt"
    for b in 1 32; do
      .venv/bin/python benchmarks/profile_decode.py --batch $b --steps 32 --threads 2 --prompt-len 256 | tee "$OUT/cpu_profile_b$b.txt"
      .venv/bin/python benchmarks/profile_decode.py --batch $b --steps 32 --threads 2 --prompt-len 256 --module-path \
        | tee "$OUT/cpu_profile_b${b}_modules.txt"
    done
    .venv/bin/python benchmarks/quantized_smollm2_cpu.py 2 gguf int8 int4-g32 | tee "$OUT/cpu_accuracy.txt" ;;
  kquant)  # K-quant GGUFs (SmolLM2 requantized from Q4_1 by llama.cpp) vs llama.cpp on the same files
    .venv/bin/python benchmarks/kquant_smollm2.py /tmp/treadle-bench Q4_K_M Q6_K 2>/dev/null | tee "$OUT/kquant_check.txt"
    for f in Q4_K_M Q6_K; do
      $T bench latency --model /tmp/treadle-bench/SmolLM2-135M-Instruct.$f.gguf --backends treadle,llamacpp \
        --input-len 256 --output-len 32 --iters 3 $TH --save-result "$OUT/kquant_$f.json" 2>"$OUT/kquant_$f.err" \
        | tee "$OUT/kquant_$f.txt"
    done ;;
  spec)  # speculative decoding (n-gram): off vs on at batch 1 and at 32 concurrent, grounded prompts
    SPEC='{"method": "ngram", "num_speculative_tokens": 4}'
    $T bench latency --model $M --workload grounded --output-len 128 --backends treadle-nospec,treadle \
      --speculative-config "$SPEC" --iters 3 --no-roofline $TH --save-result "$OUT/spec_latency.json" \
      2>"$OUT/spec_latency.err" | tee "$OUT/spec_latency.txt"
    $T bench throughput --model $M --workload grounded --num-prompts 32 --output-len 128 --concurrency 32 \
      --repeats 2 --backends treadle-nospec,treadle --speculative-config "$SPEC" --no-roofline $TH \
      --save-result "$OUT/spec_c32.json" 2>"$OUT/spec_c32.err" | tee "$OUT/spec_c32.txt" ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
