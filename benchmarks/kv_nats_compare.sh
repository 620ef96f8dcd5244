#!/usr/bin/env bash
# Scenario C over NATS and in-process, kv against round-robin: 3 rounds, fresh servers per run,
# then the medians and ratios (bench_kv_http.py --report). About 2 minutes; keep the machine idle.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/bench/nats_kv.jsonl}; mkdir -p "$(dirname "$OUT")"; : > "$OUT"
for r in 0 1 2; do
  for router in kv round-robin; do
    benchmarks/kv_nats_stack.sh start $router >/dev/null
    .venv/bin/python benchmarks/bench_kv_http.py --url http://127.0.0.1:8200 --model smollm2 \
      --label nats-$router --seed $r --runs 1 --json $OUT > /tmp/bench/nats-$router-$r.txt 2>&1
    benchmarks/kv_nats_stack.sh stop
    .venv/bin/llm-pipeline serve --engine mocker --decode-workers 4 --router $router \
      --mocker-cache-blocks 1024 --kv-block-size 16 --mocker-prefill-ms-per-token 0.05 \
      --mocker-decode-ms-per-step 7.5 --mocker-tokens random --model-name smollm2 --port 8201 > /tmp/bench/inproc.log 2>&1 &
    pid=$!
    for _ in $(seq 1 80); do curl -s -o /dev/null localhost:8201/health && break; sleep 0.25; done
    .venv/bin/python benchmarks/bench_kv_http.py --url http://127.0.0.1:8201 --model smollm2 \
      --label inproc-$router --seed $r --runs 1 --json $OUT > /tmp/bench/inproc-$router-$r.txt 2>&1
    kill $pid; wait $pid 2>/dev/null
  done
done
.venv/bin/python benchmarks/bench_kv_http.py --report $OUT
