#!/usr/bin/env bash
# TLS overhead (issue 10): the same 2-shard loopback route (plus a spare) with and without mutual
# TLS. Prints, per mode, the route's decode rate and the time from a kill -9 of the last shard to
# the next token (detect + reconnect/handshake + re-route + replay into the spare).
#   [SHARD_THREADS=1] [REPEAT=3] bash scripts/bench-tls.sh MODEL [N_TOKENS]
set -euo pipefail
trap "" PIPE # a generate that died early must not kill the script through its FIFO
cd "$(dirname "$0")/.."
model=${1:?usage: bench-tls.sh MODEL [N_TOKENS]}
n=${2:-64}
bin=build/kvshard
tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$tmp"; }
trap cleanup EXIT
$bin cert --out "$tmp/pki" a b s client 2>/dev/null
layers=$($bin inspect "$model" | awk -F' = ' '/^llama.block_count/ {print $2}')
half=$((layers / 2))
field() { sed -n "s/.*\"$1\":\([0-9.]*\).*/\1/p"; }
prompt="Once upon a time, in a small village by the sea, there lived an old fisherman"
port=""
start() { # layers name tls(0/1): starts a shard, sets $port and $pid
  local sec=()
  [ "$3" = 1 ] && sec=(--tls-cert "$tmp/pki/$2.pem" --tls-key "$tmp/pki/$2.key" --tls-ca "$tmp/pki/ca.pem")
  $bin serve -m "$model" --layers "$1" --listen 127.0.0.1:0 -t "${SHARD_THREADS:-1}" "${sec[@]}" >/dev/null 2>"$tmp/$2.log" &
  pid=$!
  pids+=($pid)
  for _ in $(seq 1 3000); do
    port=$(sed -n 's/.*listening on port \([0-9]*\)$/\1/p' "$tmp/$2.log" | head -1)
    [ -n "$port" ] && return
    sleep 0.01
  done
  echo "server did not start: $(cat "$tmp/$2.log")" >&2; exit 1
}
for tls in ${MODES:-0 1}; do
  csec=()
  [ "$tls" = 1 ] && csec=(--tls-cert "$tmp/pki/client.pem" --tls-key "$tmp/pki/client.key" --tls-ca "$tmp/pki/ca.pem")
  mode=$([ "$tls" = 1 ] && echo "mutual TLS 1.3" || echo "plaintext")
  for r in $(seq 1 "${REPEAT:-3}"); do
    start "0:$half" a "$tls"; pa=$port
    start "$half:$layers" b "$tls"; pb=$port; pidb=$pid
    start "$half:$layers" s "$tls"; ps=$port
    route="127.0.0.1:$pa,127.0.0.1:$pb"
    $bin generate --route "$route" -p "$prompt" -n 4 --temp 0 "${csec[@]}" >/dev/null 2>"$tmp/w.err" ||
      { echo "$mode run $r: warm-up generate failed:" >&2; cat "$tmp/w.err" >&2; exit 1; }
    $bin generate --route "$route" -p "$prompt" -n "$n" --temp 0 --stats "${csec[@]}" 2>"$tmp/g.err" >/dev/null ||
      { echo "$mode run $r: generate failed:" >&2; cat "$tmp/g.err" >&2; exit 1; }
    tps=$(grep '^{' "$tmp/g.err" | field decode_tok_s)
    rm -f "$tmp/in"; mkfifo "$tmp/in"
    $bin generate --route "$route" --spare "127.0.0.1:$ps" -p "$prompt" -n 16 --temp 0 --stats \
      --pause-after 8 "${csec[@]}" <"$tmp/in" >/dev/null 2>"$tmp/fo.err" &
    gp=$!
    exec 3>"$tmp/in"
    for _ in $(seq 1 3000); do grep -q "paused after" "$tmp/fo.err" && break; sleep 0.01; done
    kill -9 "$pidb"
    wait "$pidb" 2>/dev/null || true
    echo >&3 || true; exec 3>&-
    if ! wait "$gp"; then echo "$mode run $r: the failover generate failed:" >&2; cat "$tmp/fo.err" >&2; exit 1; fi
    fo=$(grep '^{' "$tmp/fo.err" | field resume_step_ms)
    echo "$mode run $r: decode_tok_s=$tps failover_next_token_ms=$fo"
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    pids=()
  done
done
