#!/usr/bin/env bash
# Dynamo 1.6.1 for the KV-routing benchmark (issue 16): its Rust frontend + FOUR mocker
# workers (one `dynamo.mocker --num-workers` process), file discovery, TCP request plane,
# ZMQ event plane (the default with file discovery), everything on loopback; modelled on
# ../shared/bench/dynamo/stack.sh (set up as its README says, SCRATCH=/tmp/bench).
#   dynamo_kv_stack.sh start kv            # frontend --router-mode kv (KV events from the mockers)
#   dynamo_kv_stack.sh start round-robin   # frontend --router-mode round-robin
#   dynamo_kv_stack.sh stop                # kill the PIDs this script started (never by name)
# Env: ROOT (${SCRATCH:-/tmp/bench}/dynamo), PORT (8100), MODEL_DIR ($ROOT/smollm2), MODEL (smollm2),
#      WORKERS (4), BLOCK_SIZE (16), GPU_BLOCKS (1024 per worker), SPEEDUP (1.0),
#      SYSTEM_PORT (8181: the mocker process's /metrics), EXTRA_FRONTEND / EXTRA_MOCKER (more flags)
set -euo pipefail
ROOT="${ROOT:-${SCRATCH:-${TMPDIR:-/tmp}/bench}/dynamo}"
PY="$ROOT/venv/bin/python"
PORT="${PORT:-8100}"
MODEL_DIR="${MODEL_DIR:-$ROOT/smollm2}"
MODEL="${MODEL:-smollm2}"
WORKERS="${WORKERS:-4}"
BLOCK_SIZE="${BLOCK_SIZE:-16}"
GPU_BLOCKS="${GPU_BLOCKS:-1024}"
SPEEDUP="${SPEEDUP:-1.0}"
SYSTEM_PORT="${SYSTEM_PORT:-8181}"
LOGS="$ROOT/logs"
PIDS="$ROOT/kv_stack.pids"
mkdir -p "$LOGS"

export DYN_FILE_KV="$ROOT/kvstore_kv"
export DYN_DISCOVERY_BACKEND=file DYN_REQUEST_PLANE=tcp
export DYN_TCP_RPC_HOST=127.0.0.1 DYN_TCP_RESPONSE_STREAM_HOST=127.0.0.1
export DYN_EVENT_PLANE_HOST=127.0.0.1 DYN_SYSTEM_HOST=127.0.0.1
export DYN_LOG="${DYN_LOG:-warn}"
export DYN_SELF_HOST_METADATA=0

wait_ready() {
  for _ in $(seq 1 120); do
    if curl -s -m 2 "http://127.0.0.1:$PORT/v1/models" | grep -q "\"$MODEL\""; then
      if curl -s -m 10 -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/v1/completions" \
          -H 'content-type: application/json' \
          -d "{\"model\":\"$MODEL\",\"prompt\":\"hi\",\"max_tokens\":1}" | grep -q 200; then
        echo "ready on :$PORT ($1, $WORKERS mockers, $GPU_BLOCKS blocks of $BLOCK_SIZE, speedup $SPEEDUP)"
        return 0
      fi
    fi
    sleep 0.5
  done
  echo "not ready; see $LOGS" >&2; return 1
}

stop() {
  [ -f "$PIDS" ] || return 0
  while read -r pid; do
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -9 "$pid" 2>/dev/null || true
  done <"$PIDS"
  rm -f "$PIDS"
}

case "${1:-}" in
  start)
    mode="${2:-kv}"
    case "$mode" in kv|round-robin|random|least-loaded) ;; *) echo "unknown mode $mode" >&2; exit 2 ;; esac
    stop
    rm -rf "$DYN_FILE_KV"; mkdir -p "$DYN_FILE_KV"
    # shellcheck disable=SC2086
    nohup "$PY" -m dynamo.frontend --discovery-backend file --request-plane tcp \
      --http-host 127.0.0.1 --http-port "$PORT" --router-mode "$mode" \
      --kv-cache-block-size "$BLOCK_SIZE" ${EXTRA_FRONTEND:-} >"$LOGS/kv_frontend.log" 2>&1 &
    echo $! >>"$PIDS"
    # shellcheck disable=SC2086
    DYN_SYSTEM_PORT="$SYSTEM_PORT" DYN_SYSTEM_ENABLED=true nohup "$PY" -m dynamo.mocker \
      --model-path "$MODEL_DIR" --model-name "$MODEL" \
      --discovery-backend file --request-plane tcp --num-workers "$WORKERS" \
      --block-size "$BLOCK_SIZE" --num-gpu-blocks-override "$GPU_BLOCKS" \
      --speedup-ratio "$SPEEDUP" --enable-prefix-caching ${EXTRA_MOCKER:-} \
      >"$LOGS/kv_mocker.log" 2>&1 &
    echo $! >>"$PIDS"
    wait_ready "$mode" ;;
  stop) stop ;;
  *) sed -n 2,11p "$0"; exit 2 ;;
esac
