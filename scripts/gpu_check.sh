#!/usr/bin/env bash
# GPU host acceptance check (under 5 minutes): doctor, plan, then a real deployment of two
# replicas sharing GPU 0 (workers_per_gpu: 2), a few requests to each replica, each worker's
# visible GPU and memory, and a clean shutdown. Exit 0 only when every step held.
#
#   scripts/gpu_check.sh                      # ports 18100/18101, the embedded default model
#   PORT=9000 ADMIN_PORT=9001 MODEL=/models/llama-2-7b-hf scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PORT=${PORT:-18100}
ADMIN_PORT=${ADMIN_PORT:-18101}
MODEL=${MODEL:-smollm2-135m-instruct}
REQUESTS_PER_REPLICA=${REQUESTS_PER_REPLICA:-3}
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3 )}
LD=${LLAMADEPLOY:-$( [ -x .venv/bin/llamadeploy ] && echo .venv/bin/llamadeploy || command -v llamadeploy || true )}
DEADLINE=$((SECONDS + 285))
WORK=$(mktemp -d -t gpu_check.XXXXXX)
LAUNCHER=""

step() { printf '\n=== [%3ds] %s\n' "$SECONDS" "$*"; }
die() {
  printf '\nFAIL (%s): %s\n' "${CURRENT:-setup}" "$*" >&2
  if [ -s "$WORK/up.log" ]; then echo "--- last 40 lines of the deployment log ($WORK/up.log):" >&2; tail -n 40 "$WORK/up.log" >&2; fi
  exit 1
}
left() { echo $((DEADLINE - SECONDS)); }
cleanup() {
  local code=$?
  if [ -n "$LAUNCHER" ] && kill -0 "$LAUNCHER" 2>/dev/null; then
    kill -TERM "$LAUNCHER" 2>/dev/null || true
    for _ in $(seq 1 40); do kill -0 "$LAUNCHER" 2>/dev/null || break; sleep 1; done
    kill -KILL "$LAUNCHER" 2>/dev/null || true  # its children die with it (PR_SET_PDEATHSIG)
  fi
  [ "$code" -eq 0 ] && rm -rf "$WORK"
  exit "$code"
}
trap cleanup EXIT
trap 'die "interrupted"' INT TERM

CURRENT="prerequisites"
[ -n "$LD" ] || die "llamadeploy is not installed (run scripts/setup.sh first)"
command -v nvidia-smi >/dev/null || die "nvidia-smi not found: this script needs a host with an NVIDIA GPU and driver"
command -v curl >/dev/null || die "curl not found"
nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv \
  || die "nvidia-smi cannot talk to the driver"

cat > "$WORK/deploy.yaml" <<EOF
model: {name: "$MODEL", max_model_len: 1024}
router: {port: $PORT, admin_port: $ADMIN_PORT, policy: round_robin}
workers: {devices: [0], workers_per_gpu: 2, replicas: 2, max_num_seqs: 4, startup_timeout_s: 180}
logging: {format: text, level: info}
EOF

CURRENT="doctor"; step "llamadeploy doctor"
timeout 120 "$LD" doctor "$WORK/deploy.yaml" || die "doctor reported a problem (see the table above)"

CURRENT="plan"; step "llamadeploy plan"
timeout 60 "$LD" plan "$WORK/deploy.yaml" || die "the plan says two replicas of $MODEL do not fit on GPU 0"

CURRENT="up"; step "llamadeploy up (2 replicas sharing GPU 0)"
"$LD" up "$WORK/deploy.yaml" > "$WORK/up.log" 2>&1 &
LAUNCHER=$!
workers_json() { curl -sf --max-time 3 "http://127.0.0.1:$ADMIN_PORT/admin/workers"; }
ready=""
while [ "$(left)" -gt 60 ]; do
  kill -0 "$LAUNCHER" 2>/dev/null || die "llamadeploy up exited during start-up"
  if json=$(workers_json) && [ "$(echo "$json" | "$PY" -c 'import json,sys; w=json.load(sys.stdin)["workers"]; print(sum(x["state"]=="ready" for x in w))' 2>/dev/null)" = 2 ]; then
    ready=1; break
  fi
  sleep 2
done
[ -n "$ready" ] || die "two workers were not ready in time"
echo "both workers ready after ${SECONDS}s"

CURRENT="requests"; step "$((2 * REQUESTS_PER_REPLICA)) requests, round robin over the two replicas"
for i in $(seq 1 $((2 * REQUESTS_PER_REPLICA))); do
  body=$(printf '{"model": "%s", "prompt": "Count from 1 to 5:", "max_tokens": 8, "temperature": 0}' "$MODEL")
  out=$(curl -sS --max-time 60 -w '\n%{http_code}' -H 'Content-Type: application/json' -d "$body" \
        "http://127.0.0.1:$PORT/v1/completions") || die "request $i: no answer from the router"
  code=$(echo "$out" | tail -n 1)
  [ "$code" = 200 ] || die "request $i: HTTP $code: $(echo "$out" | head -n -1)"
  text=$(echo "$out" | head -n -1 | "$PY" -c 'import json,sys; print(repr(json.load(sys.stdin)["choices"][0]["text"]))') \
    || die "request $i: the answer is not a completion"
  echo "request $i: 200 $text"
done

CURRENT="workers"; step "each worker: visible GPU and memory"
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
grep -E "sees [0-9]+ GPU|GPU memory after loading" "$WORK/up.log" || true
sees=$(grep -cE "sees 1 GPU\(s\)" "$WORK/up.log" || true)
[ "$sees" = 2 ] || die "expected two workers each seeing exactly 1 GPU, the log shows $sees such line(s)"
grep -q "GPU memory after loading" "$WORK/up.log" || die "no worker logged its memory after loading"
echo "--- nvidia-smi compute processes:"
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv || true
pids=$("$PY" -c 'import json,sys; print(" ".join(str(w["pid"]) for w in json.load(open(sys.argv[1]))["workers"]))' "$WORK/workers.json")

CURRENT="shutdown"; step "shutdown (SIGTERM to the launcher)"
kill -TERM "$LAUNCHER"
status=""
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

printf '\nPASS: doctor, plan, 2 replicas on GPU 0, %d requests, clean shutdown in %ds\n' \
  "$((2 * REQUESTS_PER_REPLICA))" "$SECONDS"
