#!/usr/bin/env bash
# Prefill/decode disaggregation behind `treadle router` vs one colocated instance (issue 15):
# `treadle bench serve` on a workload of long prompts arriving among ongoing decodes, and a
# decode-only run of the same decodes. Servers run one setup at a time and are killed after.
#   bash benchmarks/pd_router.sh            # results in $OUT (default /tmp/treadle-bench/pd)
#   STEPS=colocated COLOCATED_THREADS="2 1" bash benchmarks/pd_router.sh   # only (a), at 2 and at 1 thread
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
T="$PY -m treadle.entrypoints.cli"
M=${M:-smollm2-135m-instruct}
OUT=${OUT:-/tmp/treadle-bench/pd}
mkdir -p "$OUT"
SERVE="--max-model-len 2048 --kv-cache-memory 512MiB --log-level warning"
# sized for a 2-core machine shared with other jobs (load average ~15 when measured):
# 4 decodes (32-token prompts, 48 tokens out) interleaved with 4 long prompts (512 tokens, 4 out), 1 req/s
MIXED=${MIXED:-"--workload mixed --input-len 32:512 --output-len 4:48 --num-prompts 8 --request-rate 1"}
# the same 4 decodes alone, at the same arrival rate of decodes (0.5 req/s)
DECODE=${DECODE:-"--workload fixed --input-len 32 --output-len 48 --num-prompts 4 --request-rate 0.5"}
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -9 -- "-$p" 2>/dev/null || true; done; PIDS=(); }
trap cleanup EXIT
start() {  # start NAME ARGS... in its own process group
  local name=$1; shift
  setsid $T "$@" >"$OUT/$name.log" 2>&1 & PIDS+=($!)
}
wait_up() { for _ in $(seq 600); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.5; done; echo "$1 did not start"; exit 1; }
bench() {  # bench LABEL URL WORKLOAD...
  local label=$1 url=$2; shift 2
  $T bench serve --base-url "$label=$url" --model $M "$@" --save-result "$OUT/$label.json" 2>"$OUT/$label.err" \
    | tee "$OUT/$label.txt"
}

STEPS=${STEPS:-"colocated pd"}
[[ " $STEPS " == *" colocated "* ]] && for th in ${COLOCATED_THREADS:-2}; do  # (a) one colocated instance with the threads P and D have together
  start colocated$th serve $M --port 18300 --threads $th $SERVE
  wait_up http://127.0.0.1:18300
  bench colocated-t$th-mixed http://127.0.0.1:18300 $MIXED
  bench colocated-t$th-decode-only http://127.0.0.1:18300 $DECODE
  cleanup
done
[[ " $STEPS " == *" pd "* ]] || exit 0
# (b) 1 prefill + 1 decode instance (one thread each) behind the router
start prefill serve $M --port 18301 --threads 1 $SERVE --kv-transfer-config '{"kv_connector": "tcp", "kv_role": "kv_producer"}'
start decode serve $M --port 18302 --threads 1 $SERVE --kv-transfer-config '{"kv_connector": "tcp", "kv_role": "kv_consumer"}'
wait_up http://127.0.0.1:18301; wait_up http://127.0.0.1:18302
start router router --prefill http://127.0.0.1:18301 --decode http://127.0.0.1:18302 --port 18300 --log-level warning
wait_up http://127.0.0.1:18300
bench pd-mixed http://127.0.0.1:18300 $MIXED
bench pd-decode-only http://127.0.0.1:18300 $DECODE
curl -s http://127.0.0.1:18302/metrics | grep -E "^treadle:kv_transfer" > "$OUT/pd-decode-kv-metrics.txt" || true
curl -s http://127.0.0.1:18300/metrics | grep -E "^treadle:router_(retries|prefill_fallbacks|stream_errors)_total" \
  > "$OUT/pd-router-metrics.txt" || true
