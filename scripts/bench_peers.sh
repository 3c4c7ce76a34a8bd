#!/usr/bin/env bash
# Ours against llama.cpp's llama-server (and, where built, ik_llama.cpp's) at the same precision, one server at a
# time on this machine, with `llamadeploy bench` (engine suite); ends with one compact table of ratios.
#
#   LLAMA_SERVER=.../llama-server GGUF_Q41=... GGUF_Q80=... GGUF_BF16=... GGUF_F32=... \
#     [IK_SERVER=.../ik/llama-server] bash scripts/bench_peers.sh OUTDIR [PAIR ...]
#
# PAIR (default: all four): q41 (ours' default deploy of the model vs llama-server on GGUF_Q41, the file it serves),
# int8 (`quantization: int8` vs GGUF_Q80), bf16 (`dtype: bfloat16` vs GGUF_BF16), f32 (`dtype: float32` vs
# GGUF_F32). With IK_SERVER set, ik_llama.cpp's server runs the q41 and int8 pairs' files too; ours is compared
# against both. A pair whose GGUF variable is unset is skipped.
# Environment: MODEL (ours' model.name, default smollm2-135m-instruct), TOKENIZER (default MODEL), THREADS (the
# peers' -t, default nproc), PORT (ours' router port, default 8000; admin PORT+1; peers PORT+400),
# LLAMADEPLOY (default: `python -m launcher.cli` of the venv that runs this), BENCH_ARGS (extra `bench` options),
# QUICK=1 (tiny settings: proves the script works; its figures mean nothing).
# Peers run as `setsid llama-server -m FILE -np 8 -t THREADS -c 16384`: 8 slots of 2048 tokens, the document's 1.5k
# fits; each server (ours' workers too) in a session of its own, apart from the bench client's.
# Ours is stopped by its process id (SIGINT, then waited for); nothing is stopped by name.
set -u
OUT=${1:?usage: bench_peers.sh OUTDIR [q41|int8|bf16|f32 ...]}; shift
PAIRS=${*:-q41 int8 bf16 f32}
MODEL=${MODEL:-smollm2-135m-instruct}; TOKENIZER=${TOKENIZER:-$MODEL}
THREADS=${THREADS:-$(nproc)}; PORT=${PORT:-8000}; PEER_PORT=$((PORT + 400))
PY=${PY:-python3}; LD=${LLAMADEPLOY:-$PY -m launcher.cli}
BENCH_ARGS=${BENCH_ARGS:-}
[ "${QUICK:-0}" = 1 ] && BENCH_ARGS="--prompts 2 --clients 2 --warmup 1 --requests 2 --output-tokens 8 \
  --doc-tokens 200 --doc-output-tokens 4 --streams 2 $BENCH_ARGS"
mkdir -p "$OUT"
log() { echo "[$(date -u +%H:%M:%S)] $*"; }
loadavg() { cut -d' ' -f1-3 /proc/loadavg 2>/dev/null; }
log "load average $(loadavg) (each server's bench is only worth its figures on an otherwise idle machine)"

wait_up() { # URL PID SECONDS: 0 once URL answers 200, 1 if the process ended or time ran out
  local i
  for ((i = 0; i < $3; i++)); do
    curl -sf "$1" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 1
  done
  return 1
}

peer() { # NAME SERVER FILE PORT: one peer server, its bench, stopped
  local name=$1 port=$4 pid
  # a session of its own, as `llamadeploy up` starts its workers (and a user's shell or systemd starts a server): with
  # autogroup scheduling a session is one scheduling entity, so the bench client must not share the server's
  setsid "$2" -m "$3" -c 16384 -np 8 -t "$THREADS" --host 127.0.0.1 --port "$port" >"$OUT/$name.log" 2>&1 &
  pid=$!
  if wait_up "http://127.0.0.1:$port/health" "$pid" 180; then
    log "$name: bench (load average $(loadavg))"
    # shellcheck disable=SC2086
    $LD bench "http://127.0.0.1:$port/v1" --model "$MODEL" --tokenizer "$TOKENIZER" --label "$name" \
      --output "$OUT/$name" $BENCH_ARGS >"$OUT/$name.out" 2>&1 || log "$name: bench failed (see $OUT/$name.out)"
  else
    log "$name: did not start (see $OUT/$name.log)"
  fi
  kill "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
}

ours() { # PAIR MODEL_EXTRA COMPARE...: our deployment, its bench against the peers' JSON, stopped
  local name=ours-$1 pid cmp=()
  printf 'model: {name: %s%s}\nrouter: {port: %s, admin_port: %s}\nworkers: {devices: cpu, replicas: 1}\n' \
    "$MODEL" "$2" "$PORT" "$((PORT + 1))" >"$OUT/$name.yaml"
  shift 2
  for f in "$@"; do [ -f "$f" ] && cmp+=(--compare "$f"); done
  $LD up "$OUT/$name.yaml" >"$OUT/$name.log" 2>&1 &
  pid=$!
  if wait_up "http://127.0.0.1:$PORT/health/ready" "$pid" 900; then
    log "$name: bench (load average $(loadavg))"
    # shellcheck disable=SC2086
    $LD bench "http://127.0.0.1:$PORT/v1" --tokenizer "$TOKENIZER" --label "$name" --output "$OUT/$name" \
      "${cmp[@]}" $BENCH_ARGS >"$OUT/$name.out" 2>&1 || log "$name: bench failed (see $OUT/$name.out)"
  else
    log "$name: did not become ready (see $OUT/$name.log)"
  fi
  kill -INT "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
}

for p in $PAIRS; do
  case $p in
    q41) file=${GGUF_Q41:-}; extra="" ;;
    int8) file=${GGUF_Q80:-}; extra=", quantization: int8" ;;
    bf16) file=${GGUF_BF16:-}; extra=", dtype: bfloat16, quantization: none" ;;
    f32) file=${GGUF_F32:-}; extra=", dtype: float32, quantization: none" ;;
    *) log "unknown pair $p (q41, int8, bf16, f32)"; continue ;;
  esac
  [ -n "$file" ] || { log "$p: no GGUF file given, skipped"; continue; }
  log "$p: llama-server on $file"
  peer "peer-$p" "${LLAMA_SERVER:?set LLAMA_SERVER}" "$file" "$PEER_PORT"
  if [ -n "${IK_SERVER:-}" ] && { [ "$p" = q41 ] || [ "$p" = int8 ]; }; then
    log "$p: ik_llama.cpp's server on $file"
    # its own port: the server before it leaves the port's closed connections in TIME_WAIT, and ik's
    # server binds without SO_REUSEADDR ("couldn't bind to server socket")
    peer "ik-$p" "$IK_SERVER" "$file" "$((PEER_PORT + 1))"
  fi
  log "$p: ours ($MODEL$extra)"
  ours "$p" "$extra" "$OUT/peer-$p.json" "$OUT/ik-$p.json"
done
log "done"
$PY "$(dirname "$0")/bench_peers_summary.py" "$OUT" | tee "$OUT/summary.md"
