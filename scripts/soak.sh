#!/usr/bin/env bash
# Soak of the hot KV state under pressure (issue 7): a 2-shard route of stories260K whose shards
# each hold a KV budget for 2 sessions, a spare for each layer range, 8 clients generating in a
# loop, and a route shard killed (kill -9) at random 5 times in the soak (then restarted on its port).
# Every completed output must equal the prompt's solo run, no run may fail after its route was
# open, and at the end every shard's KV bytes must be back to 0.
#
# usage: scripts/soak.sh [SECONDS (300)] [KILLS (5)]     env: KVS_BIN, KVS_SHARED_DIR, SOAK_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-300}"
kills="${2:-5}"
bin="${KVS_BIN:-build/kvshard}"
model="${KVS_SHARED_DIR:-../shared}/models/stories260K.gguf"
dir="${SOAK_DIR:-$(mktemp -d /tmp/kvs-soak-XXXXXX)}"
n_clients=8
n_tokens=40
[ -x "$bin" ] || { echo "soak: $bin not built" >&2; exit 1; }
[ -r "$model" ] || { echo "soak: $model missing" >&2; exit 77; }
mkdir -p "$dir"

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for n in h t sh st; do [ -f "$dir/$n.pid" ] && kill "$(cat "$dir/$n.pid")" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

# serve NAME LAYERS PORT BUDGET: starts a shard (PORT 0: a free one) and records its pid and port.
serve() {
  local name=$1 layers=$2 port=$3 budget=$4
  "$bin" serve -m "$model" --layers "$layers" --listen "127.0.0.1:$port" --kv-budget "$budget" -t 1 \
    --kv-ttl 600 >>"$dir/$name.log" 2>&1 &
  echo $! >"$dir/$name.pid"
  for _ in $(seq 2000); do
    local p
    p=$(grep -o 'listening on port [0-9]*' "$dir/$name.log" | tail -1 | awk '{print $4}' || true)
    if [ -n "$p" ] && { [ "$port" = 0 ] || [ "$p" = "$port" ]; } && grep -q "listening on port $p (" "$dir/$name.log"; then
      echo "$p" >"$dir/$name.port"
      return 0
    fi
    sleep 0.01
  done
  echo "soak: shard $name did not start" >&2
  return 1
}

# Budget for 2 sessions of (prompt + n_tokens) positions: blocks of 16 positions; block bytes
# from a first start of each range.
probe() {
  : >"$dir/probe.log"
  "$bin" serve -m "$model" --layers "$1" --listen 127.0.0.1:0 -t 1 >"$dir/probe.log" 2>&1 &
  local p=$!
  for _ in $(seq 2000); do grep -q 'blocks of' "$dir/probe.log" && break; sleep 0.01; done
  kill "$p"; wait "$p" 2>/dev/null || true
  grep -o 'blocks of [0-9]* B' "$dir/probe.log" | awk '{print $3}'
}
blocks_per_session=$(( (8 + n_tokens + 15) / 16 ))
bh=$(probe 0:2)
bt=$(probe 2:end)
budget_h=$(( 2 * blocks_per_session * bh ))
budget_t=$(( 2 * blocks_per_session * bt ))

serve h 0:2 0 "$budget_h"
serve t 2:end 0 "$budget_t"
serve sh 0:2 0 "$budget_h"
serve st 2:end 0 "$budget_t"
addr() { echo "127.0.0.1:$(cat "$dir/$1.port")"; }
route="$(addr h),$(addr t)"
spares="$(addr sh),$(addr st)"
echo "soak: route $route, spares $spares; budgets $budget_h B (head) / $budget_t B (tail) = 2 sessions of $(( blocks_per_session * 16 )) positions; $n_clients clients; $secs s; $kills kills; dir $dir"

prompts=("Once upon a time" "The little dog" "Lily wanted to" "One day a bird" "Tom and Sam"
         "The sun was" "A girl named Sue" "There was a big")
# Solo runs: each prompt alone on a quiet route.
for i in $(seq 0 $((n_clients - 1))); do
  "$bin" generate --route "$route" -p "${prompts[$i]}" -n "$n_tokens" --temp 0 --json >"$dir/solo-$i.json"
done

# client I: generates in a loop until the deadline; counts runs, mismatches, failures.
client() {
  local i=$1 deadline=$2 runs=0 bad=0 failed=0 refused=0 reroutes=0
  while [ "$(date +%s)" -lt "$deadline" ]; do
    local rc=0
    "$bin" generate --route "$route" --spare "$spares" -p "${prompts[$i]}" -n "$n_tokens" --temp 0 --json \
      --stats --timeout 10000 >"$dir/out-$i.json" 2>"$dir/err-$i.log" || rc=$?
    if [ "$rc" -ne 0 ]; then
      if grep -q 'cannot connect' "$dir/err-$i.log" && ! grep -q '"reroutes"' "$dir/err-$i.log"; then
        refused=$((refused + 1)) # route_open met the shard being restarted: nothing ran
        sleep 0.05
        continue
      fi
      failed=$((failed + 1))
      cp "$dir/err-$i.log" "$dir/failed-$i-$runs.log"
      continue
    fi
    runs=$((runs + 1))
    cmp -s "$dir/out-$i.json" "$dir/solo-$i.json" || { bad=$((bad + 1)); cp "$dir/out-$i.json" "$dir/bad-$i-$runs.json"; }
    local r
    r=$(grep -o '"reroutes":[0-9]*' "$dir/err-$i.log" | head -1 | cut -d: -f2)
    reroutes=$((reroutes + ${r:-0}))
  done
  echo "$runs $bad $failed $refused $reroutes" >"$dir/client-$i.result"
}

start=$(date +%s)
deadline=$((start + secs))
for i in $(seq 0 $((n_clients - 1))); do client "$i" "$deadline" & pids+=($!); done

# Killer: kills at random times (about secs / (kills + 1) apart), each a random shard of the
# route (head or tail: the clients in flight on it fail over to its spare), restarted on its
# port right after (later runs use it again).
gap=$(( secs / (kills + 1) ))
names=(h t)
for k in $(seq 1 "$kills"); do
  sleep $(( gap / 2 + RANDOM % (gap > 1 ? gap : 1) ))
  [ "$(date +%s)" -lt "$deadline" ] || break
  n=${names[$((RANDOM % 2))]}
  port=$(cat "$dir/$n.port")
  kill -9 "$(cat "$dir/$n.pid")"
  wait "$(cat "$dir/$n.pid")" 2>/dev/null || true
  echo "soak: kill $k at +$(( $(date +%s) - start )) s: shard $n (port $port), restarting"
  serve "$n" "$( [ "$n" = h ] || [ "$n" = sh ] && echo 0:2 || echo 2:end )" "$port" \
    "$( [ "$n" = h ] || [ "$n" = sh ] && echo "$budget_h" || echo "$budget_t" )"
done
for p in "${pids[@]}"; do wait "$p"; done
pids=()

total_runs=0 total_bad=0 total_failed=0 total_refused=0 total_reroutes=0
for i in $(seq 0 $((n_clients - 1))); do
  read -r runs bad failed refused reroutes <"$dir/client-$i.result"
  total_runs=$((total_runs + runs)); total_bad=$((total_bad + bad)); total_failed=$((total_failed + failed))
  total_refused=$((total_refused + refused)); total_reroutes=$((total_reroutes + reroutes))
done
bytes_total=0
for n in h t sh st; do
  s=$("$bin" stats "$(addr "$n")")
  b=$(echo "$s" | grep -o '"kv.bytes_used":[0-9]*' | cut -d: -f2)
  ev=$(echo "$s" | grep -o '"kv.evict_lru":[0-9]*' | cut -d: -f2)
  inpl=$(echo "$s" | grep -o '"kv.in_place":[0-9]*' | cut -d: -f2)
  echo "soak: shard $n: kv.bytes_used $b, kv.evict_lru $ev, kv.in_place ${inpl:-?} (since its last start)"
  bytes_total=$((bytes_total + b))
done
echo "soak: $total_runs runs completed, $total_bad outputs differing from the solo run, $total_failed runs failed," \
  "$total_refused opens refused during a restart (retried), $total_reroutes re-routes; KV bytes at the end: $bytes_total"
[ "$total_bad" -eq 0 ] && [ "$total_failed" -eq 0 ] && [ "$bytes_total" -eq 0 ] && [ "$total_runs" -gt 0 ]
