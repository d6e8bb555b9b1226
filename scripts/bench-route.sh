#!/usr/bin/env bash
# Route benchmark (issue: shard server and route client). Prints one line per figure.
#   [SHARD_THREADS=2] bash scripts/bench-route.sh MODEL [N_TOKENS]
# 1. one-process `kvshard run` decode rate; 2. the same through a 2-shard loopback route;
# 3. four concurrent clients through that route (aggregate); 4. wire bytes per decoded token;
# 5. time from a shard's death to the next token (kill -9 while the client is paused, spare up);
# 6. latency matrix (issue 11): a delay proxy (`kvshard delay-proxy`, holds each chunk D ms each way)
#    in front of every shard, so every link (client-shard and shard-shard) has a one-way latency of
#    D ms: decode tok/s and wire bytes per decoded token (all links, counted by the proxies) for 1, 2
#    and 3 shards, relay vs client-driven (--no-relay), D = 0, 2, 10 ms; then 4 concurrent sessions
#    over 2 shards vs 1 session (relay). PARTS=latency runs only this part, PARTS=route only 1-5;
#    NLAT tokens per run (default 32), REPS runs per figure, the best kept (default 3); SHARDS and
#    DELAYS narrow the matrix (defaults "1 2 3" and "0 2 10"), CONC=0 skips the concurrency part.
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:?usage: bench-route.sh MODEL [N_TOKENS]}
n=${2:-64}
bin=build/kvshard
tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$tmp"; }
trap cleanup EXIT
layers=$($bin inspect "$model" | awk -F' = ' '/\.block_count/ {print $2; exit}')
parts=${PARTS:-all}
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
if [ "$parts" != latency ]; then
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
fi

[ "$parts" = route ] && exit 0
# ---- 6. latency matrix ----
proxy() { # target_port delay log: starts a delay proxy, sets $port
  $bin delay-proxy --to "127.0.0.1:$1" --delay-ms "$2" 2>"$tmp/$3" &
  pids+=($!); proxy_pids+=($!)
  for _ in $(seq 1 3000); do
    port=$(sed -n 's/.*listening on port \([0-9]*\)$/\1/p' "$tmp/$3" | head -1)
    [ -n "$port" ] && return
    sleep 0.01
  done
  echo "proxy did not start" >&2; exit 1
}
proxy_bytes() { # sum of bytes forwarded by the current proxies
  local total=0 p
  for p in "${proxy_pids[@]}"; do kill -USR1 "$p"; done
  sleep 0.2
  for i in $(seq 0 $((${#proxy_pids[@]} - 1))); do
    p=$(grep 'bytes to_target' "$tmp/px$i.log" | tail -1 | awk -F'[= ]' '{print $(NF-2) + $NF}')
    total=$((total + p))
  done
  echo "$total"
}
splits() { # n: layer ranges of an n-shard split
  case $1 in
    1) echo "0:$layers" ;;
    2) echo "0:$half $half:$layers" ;;
    3) echo "0:$((layers / 3)) $((layers / 3)):$((2 * layers / 3)) $((2 * layers / 3)):$layers" ;;
  esac
}
nl=${NLAT:-32}
echo "latency matrix: decode of $nl tokens (greedy), one client, best of ${REPS:-3} runs; bytes per decoded token over all links"
echo "shards delay_ms mode decode_tok_s bytes_per_token"
for ns in ${SHARDS:-1 2 3}; do
  shard_ports=()
  i=0
  for r in $(splits $ns); do start "$r" "lat$ns-$i.log"; shard_ports+=("$port"); i=$((i + 1)); done
  for d in ${DELAYS:-0 2 10}; do
    proxy_pids=(); routes=""
    for i in $(seq 0 $((ns - 1))); do
      proxy "${shard_ports[$i]}" "$d" "px$i.log"
      routes="$routes${routes:+,}127.0.0.1:$port"
    done
    for mode in relay client; do
      flag=""; [ "$mode" = client ] && flag="--no-relay"
      $bin generate --route "$routes" -p "$prompt" -n 2 --temp 0 $flag >/dev/null 2>&1 # connect + warm
      b0=$(proxy_bytes)
      $bin generate --route "$routes" -p "$prompt" -n 4 --temp 0 $flag >/dev/null 2>&1
      b1=$(proxy_bytes)
      st=$($bin generate --route "$routes" -p "$prompt" -n $((nl + 4)) --temp 0 --stats $flag 2>&1 >/dev/null | grep '^{')
      b2=$(proxy_bytes)
      best=$(echo "$st" | field decode_tok_s)
      for _ in $(seq 2 "${REPS:-3}"); do # best of REPS: the machine is shared
        t=$($bin generate --route "$routes" -p "$prompt" -n $((nl + 4)) --temp 0 --stats $flag 2>&1 >/dev/null | grep '^{' | field decode_tok_s)
        best=$(echo "$best $t" | awk '{print ($2 > $1) ? $2 : $1}')
      done
      echo "$ns $d $mode $best $(( (b2 - b1 - (b1 - b0)) / nl ))"
    done
    for p in "${proxy_pids[@]}"; do kill "$p" 2>/dev/null || true; done
  done
done
[ "${CONC:-1}" = 0 ] && exit 0
echo "concurrency: 2 shards, relay, $nl tokens per session; aggregate decode tok/s"
shard_ports=(); i=0
for r in $(splits 2); do start "$r" "conc-$i.log"; shard_ports+=("$port"); i=$((i + 1)); done
for d in 0 10; do
  proxy_pids=(); routes=""
  for i in 0 1; do proxy "${shard_ports[$i]}" "$d" "px$i.log"; routes="$routes${routes:+,}127.0.0.1:$port"; done
  $bin generate --route "$routes" -p "$prompt" -n 2 --temp 0 >/dev/null 2>&1
  one=$($bin generate --route "$routes" -p "$prompt" -n "$nl" --temp 0.8 --seed 1 --stats 2>&1 >/dev/null | grep '^{' | field decode_tok_s)
  cp=()
  for c in 1 2 3 4; do
    $bin generate --route "$routes" -p "$prompt $c" -n "$nl" --temp 0.8 --seed "$c" --stats 2>"$tmp/cc$c.err" >/dev/null &
    cp+=($!)
  done
  wait "${cp[@]}"
  agg=$(for c in 1 2 3 4; do grep '^{' "$tmp/cc$c.err" | field decode_tok_s; done | awk '{s += $1} END {printf "%.2f", s}')
  echo "D=$d ms: 1 session $one tok/s; 4 concurrent sessions: aggregate $agg tok/s (sum of per-session decode rates)"
  for p in "${proxy_pids[@]}"; do kill "$p" 2>/dev/null || true; done
done
