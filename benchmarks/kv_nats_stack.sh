#!/usr/bin/env bash
# Ours over NATS for the KV-routing benchmark (issue 16): nats-server (JetStream), FOUR
# `llm-pipeline worker --engine mocker` processes with a prefix cache each, publishing
# their KV events, and `llm-pipeline serve --nats` routing with --router kv or round-robin.
#   kv_nats_stack.sh start kv            # frontend --router kv (index fed over NATS)
#   kv_nats_stack.sh start round-robin   # frontend --router round-robin
#   kv_nats_stack.sh stop                # kill the PIDs this script started (never by name)
# Env: ROOT (/tmp/bench/ours-nats), PORT (8200), NATS_PORT (4333), MODEL (smollm2),
#      WORKERS (4), BLOCK_SIZE (16), CACHE_BLOCKS (1024 per worker),
#      PREFILL_MS (0.05 per uncached token), DECODE_MS (7.5 per step)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
BIN="$HERE/../.venv/bin"
ROOT="${ROOT:-/tmp/bench/ours-nats}"
PORT="${PORT:-8200}"
NATS_PORT="${NATS_PORT:-4333}"
MODEL="${MODEL:-smollm2}"
WORKERS="${WORKERS:-4}"
BLOCK_SIZE="${BLOCK_SIZE:-16}"
CACHE_BLOCKS="${CACHE_BLOCKS:-1024}"
PREFILL_MS="${PREFILL_MS:-0.05}"
DECODE_MS="${DECODE_MS:-7.5}"
PIDS="$ROOT/pids"
URL="nats://127.0.0.1:$NATS_PORT"
mkdir -p "$ROOT/logs"

started() { echo "$1" >>"$PIDS"; }

wait_for() {  # a URL answering 200
  for _ in $(seq 1 120); do
    if curl -s -m 2 -o /dev/null -w '%{http_code}' "$1" | grep -q 200; then return 0; fi
    sleep 0.25
  done
  echo "not ready: $1 (see $ROOT/logs)" >&2; return 1
}

case "${1:-}" in
  start)
    router="${2:-kv}"
    rm -rf "$ROOT/jetstream"; : >"$PIDS"
    nohup "$BIN/nats-server" -a 127.0.0.1 -p "$NATS_PORT" -js -sd "$ROOT/jetstream" \
      >"$ROOT/logs/nats.log" 2>&1 &
    started $!
    for _ in $(seq 1 40); do (echo >/dev/tcp/127.0.0.1/"$NATS_PORT") 2>/dev/null && break; sleep 0.25; done
    for i in $(seq 0 $((WORKERS - 1))); do
      nohup "$BIN/llm-pipeline" worker --nats "$URL" --model-name "$MODEL" --engine mocker \
        --worker-id "w$i" --mocker-tokens random --mocker-cache-blocks "$CACHE_BLOCKS" \
        --kv-block-size "$BLOCK_SIZE" --mocker-prefill-ms-per-token "$PREFILL_MS" \
        --mocker-decode-ms-per-step "$DECODE_MS" >"$ROOT/logs/worker-$i.log" 2>&1 &
      started $!
    done
    nohup "$BIN/llm-pipeline" serve --nats "$URL" --model-name "$MODEL" --router "$router" \
      --kv-block-size "$BLOCK_SIZE" --port "$PORT" >"$ROOT/logs/frontend.log" 2>&1 &
    started $!
    wait_for "http://127.0.0.1:$PORT/health"
    for _ in $(seq 1 120); do  # every worker registered and routable
      n=$(grep -c "serving model" "$ROOT"/logs/worker-*.log | awk -F: '{s+=$2} END {print s}')
      [ "$n" -ge "$WORKERS" ] && break; sleep 0.25
    done
    echo "ready on :$PORT ($router, $WORKERS workers over NATS, $CACHE_BLOCKS blocks of $BLOCK_SIZE)" ;;
  stop)
    if [ -f "$PIDS" ]; then
      tac "$PIDS" | while read -r pid; do kill "$pid" 2>/dev/null || true; done
      tac "$PIDS" | while read -r pid; do
        for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
        kill -9 "$pid" 2>/dev/null || true
      done
      rm -f "$PIDS"
    fi ;;
  *) sed -n 2,10p "$0"; exit 2 ;;
esac
