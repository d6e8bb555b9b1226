#!/usr/bin/env bash
# Route benchmark (issue: shard server and route client). Prints one line per figure.
#   [SHARD_THREADS=2] bash scripts/bench-route.sh MODEL [N_TOKENS]
# 1. one-process `kvshard run` decode rate; 2. the same through a 2-shard loopback route;
# 3. four concurrent clients through that route (aggregate); 4. wire bytes per decoded token;
# 5. time from a shard's death to the next token (kill -9 while the client is paused, spare up).
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:?usage: bench-route.sh MODEL [N_TOKENS]}
n=${2:-64}
bin=build/kvshard
tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$tmp"; }
trap cleanup EXIT
layers=$($bin inspect "$model" | awk -F' = ' '/^llama.block_count/ {print $2}')
half=$((layers / 2))
port=""
start() { # layers log: starts a shard, sets $port
  $bin serve -m "$model" --layers "$1" --listen 127.0.0.1:0 -t "${SHARD_THREADS:-2}" --kv-budget 1G >/dev/null 2>"$tmp/$2" &
  pids+=($!)
  for _ in $(seq 1 3000); do
    port=$(sed -n 's/.*listening on port \([0-9]*\)$/\1/p' "$tmp/$2" | head -1)
    [ -n "$port" ] && return
    sleep 0.01
  done
  echo "server did not start: $(cat "$tmp/$2")" >&2; exit 1
}
field() { sed -n "s/.*\"$1\":\([0-9.]*\).*/\1/p"; }
prompt="Once upon a time, in a small village by the sea, there lived an old fisherman"
run_tps=$($bin run -m "$model" -p "$prompt" -n "$n" --temp 0 -t 2 --stats 2>&1 >/dev/null | field decode_tok_s)
echo "one-process run: decode_tok_s=$run_tps"
start "0:$half" a.log; pa=$port
start "$half:$layers" b.log; pb=$port
start "$half:$layers" s.log; ps=$port
route="127.0.0.1:$pa,127.0.0.1:$pb"
$bin generate --route "$route" -p "$prompt" -n 4 --temp 0 >/dev/null 2>&1 # warm the shards
st=$($bin generate --route "$route" -p "$prompt" -n "$n" --temp 0 --stats 2>&1 >/dev/null | grep '^{')
tps=$(echo "$st" | field decode_tok_s)
sent=$(echo "$st" | field wire_bytes_sent); recv=$(echo "$st" | field wire_bytes_received)
gen=$(echo "$st" | field generated); np=$(echo "$st" | field prompt_tokens)
echo "2-shard route: decode_tok_s=$tps ratio_vs_run=$(echo "$tps $run_tps" | awk '{printf "%.3f", $1/$2}')"
echo "2-shard route: wire bytes total sent=$sent received=$recv for $np prompt + $gen generated tokens;" \
     "per decoded token ~$(echo "$sent $recv $np $gen" | awk '{printf "%.0f", ($1+$2)/($3+$4)}') B (all positions)"
t0=$(date +%s.%N)
cpids=()
for i in 1 2 3 4; do
  $bin generate --route "$route" -p "$prompt $i" -n "$n" --temp 0 --stats 2>"$tmp/c$i.err" >/dev/null &
  cpids+=($!)
done
wait "${cpids[@]}"
t1=$(date +%s.%N)
total=0; for i in 1 2 3 4; do g=$(grep '^{' "$tmp/c$i.err" | field generated); total=$((total + g)); done
echo "4 concurrent clients: $total tokens in $(echo "$t0 $t1" | awk '{printf "%.2f", $2-$1}') s wall," \
     "aggregate $(echo "$total $t0 $t1" | awk '{printf "%.2f", $1/($3-$2)}') tok/s (incl. prefill)"
mkfifo "$tmp/in"
$bin generate --route "$route" --spare "127.0.0.1:$ps" -p "$prompt" -n 16 --temp 0 --stats \
  --pause-after 8 <"$tmp/in" >/dev/null 2>"$tmp/fo.err" &
gp=$!
exec 3>"$tmp/in"
for _ in $(seq 1 3000); do grep -q "paused after" "$tmp/fo.err" && break; sleep 0.01; done
kill -9 "${pids[1]}"
echo >&3; exec 3>&-
wait "$gp"
echo "failover: next token after kill -9 took $(grep '^{' "$tmp/fo.err" | field resume_step_ms) ms" \
     "(detect + re-route + replay of $((8 + $(grep '^{' "$tmp/fo.err" | field prompt_tokens))) positions into the spare)"
