#!/usr/bin/env bash
# Hot KV mobility (issue 39): drain time and throughput of SIZE_MIB of KV between two shards on
# loopback, plaintext and mutual TLS, and the --state-dir snapshot write (SIGTERM) and load
# (start) of the same KV. The KV is not prefilled (far too slow on a small CPU): build/bench_state
# writes a valid snapshot of random f16 rows (sessions of 2048 positions) for a TinyLlama-1.1B-
# shaped model, shard A loads it at start, is drained into shard B (plaintext), B is stopped
# with SIGTERM (it writes the snapshot), a TLS shard A2 starts from B's snapshot and is drained
# into a TLS shard B2. Prints a markdown table, the CPU, the commit and the load average.
#
# Build:  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DKVS_BENCH=ON && cmake --build build -j2
# Usage:  [BUILD=build] [SCRATCH=/tmp/kvshard-anchors] [SIZE_MIB=1024] [TIMEOUT_S=300] [PREFAULT=1]
#         bash scripts/bench-drain.sh
#   BUILD      the build folder holding kvshard and bench_state (default build)
#   SCRATCH    model and work files, outside the repository (tinyllama-q4_0.gguf is reused; it is
#              made with `kvshard mkmodel --shape tinyllama-1.1b --type q4_0` when missing)
#   SIZE_MIB   KV moved (default 1024: 1 GiB); needs about 3 x SIZE_MIB of RAM and of disk
#   TIMEOUT_S  bound of every wait (shard start, drain, stop)
#   PREFAULT   1: every shard starts with --kv-prefault (its pool touched before it listens, as a
#              shard that has served a while has it), 0: a fresh pool (first writes fault pages in)
# Measure on a quiet machine (cat /proc/loadavg well under 1).
set -euo pipefail
scratch=$(realpath -m "${SCRATCH:-/tmp/kvshard-anchors}")
cd "$(dirname "$0")/.."
root=$(pwd -P)
size=${SIZE_MIB:-1024}
limit=${TIMEOUT_S:-300}
prefault=${PREFAULT:-1}
build=${BUILD:-build}
bin=$build/kvshard
gen=$build/bench_state
if [ ! -x "$bin" ] || [ ! -x "$gen" ]; then
  echo "bench-drain: build $bin and $gen first (cmake ... -DKVS_BENCH=ON)" >&2; exit 1
fi
case "$scratch/" in "$root"/*) echo "bench-drain: SCRATCH $scratch is inside the repository" >&2; exit 1 ;; esac
mkdir -p "$scratch"
model=$scratch/tinyllama-q4_0.gguf
[ -f "$model" ] || $bin mkmodel -o "$model" --shape tinyllama-1.1b --type q4_0 -q
work=$(mktemp -d "$scratch/drain.XXXXXX")
pids=()
cleanup() {
  for p in "${pids[@]}"; do { kill -9 "$p" && wait "$p"; } 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
load0=$(cut -d' ' -f1-3 /proc/loadavg)
budget=$((size + 64))M
$bin cert --out "$work/pki" a b op >/dev/null 2>&1
tls_args() { echo --tls-cert "$work/pki/$1.pem" --tls-key "$work/pki/$1.key" --tls-ca "$work/pki/ca.pem"; }
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", b - a }'; }
gbs() { awk -v n="$1" -v s="$2" 'BEGIN { printf "%.2f", (s > 0 ? n / s / 1e9 : 0) }'; }
counter() { sed -n "s/.*\"$1\":\([0-9]*\).*/\1/p"; }

# start NAME STATE_DIR PEER_ALLOW [TLS_NAME]: a shard of layers 0:22; sets $port, $pid, $up_s
# (process start to "listening") and $load_s (the snapshot load as its log says, else -).
start() {
  local name=$1 dir=$2 allow=$3 sec=()
  [ -n "${4:-}" ] && read -ra sec <<<"$(tls_args "$4")"
  local t0
  t0=$(now)
  local pf=()
  [ "$prefault" = 1 ] && pf=(--kv-prefault)
  $bin serve -m "$model" --layers 0:22 --listen 127.0.0.1:0 -t 1 --kv-budget "$budget" "${pf[@]}" --state-dir "$dir" \
    --digest-cache "$scratch/digest-cache" --peer-allow "$allow" "${sec[@]}" >/dev/null 2>"$work/$name.log" &
  pid=$!
  pids+=("$pid")
  port=""
  for _ in $(seq 1 $((limit * 20))); do
    port=$(sed -n 's/.*listening on port \([0-9]*\)$/\1/p' "$work/$name.log" | head -1)
    [ -n "$port" ] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.05
  done
  [ -n "$port" ] || { echo "bench-drain: shard $name did not start:" >&2; cat "$work/$name.log" >&2; exit 1; }
  up_s=$(secs "$t0" "$(now)")
  load_s=$(sed -n 's/.*state: loaded .* in \([0-9.]*\) s$/\1/p' "$work/$name.log" | head -1)
  load_s=${load_s:--}
}

# drain FROM_PORT TO_PORT [TLS_NAME]: sets $drain_s (the drained shard's own figure), $wall_s
# (the drain command's run) and $moved (move.bytes_out of FROM, checked against TO's bytes_in).
drain() {
  local sec=() t0
  [ -n "${3:-}" ] && read -ra sec <<<"$(tls_args "$3")"
  t0=$(now)
  timeout "$limit" $bin drain "127.0.0.1:$1" --to "127.0.0.1:$2" --keep-running --timeout $((limit * 1000)) \
    "${sec[@]}" >"$work/drain.out" 2>&1 || { echo "bench-drain: drain failed:" >&2; cat "$work/drain.out" >&2; exit 1; }
  wall_s=$(secs "$t0" "$(now)")
  drain_s=$(sed -n 's/^done: .* in \([0-9.]*\) s .*/\1/p' "$work/drain.out")
  moved=$($bin stats "127.0.0.1:$1" "${sec[@]}" | counter move.bytes_out)
  local in
  in=$($bin stats "127.0.0.1:$2" "${sec[@]}" | counter move.bytes_in)
  if [ "$moved" != "$in" ] || [ "${moved:-0}" -le 0 ]; then
    echo "bench-drain: moved $moved bytes out, $in in" >&2; cat "$work/drain.out" >&2; exit 1
  fi
}

# stop PID NAME: SIGTERM, bounded wait for the exit; sets $stop_s (signal to exit) and $write_s.
stop() {
  local t0
  t0=$(now)
  kill -TERM "$1"
  for _ in $(seq 1 $((limit * 20))); do kill -0 "$1" 2>/dev/null || break; sleep 0.05; done
  kill -0 "$1" 2>/dev/null && { echo "bench-drain: shard $2 did not stop" >&2; exit 1; }
  wait "$1" || { echo "bench-drain: shard $2 exited with an error:" >&2; tail -5 "$work/$2.log" >&2; exit 1; }
  stop_s=$(secs "$t0" "$(now)")
  write_s=$(sed -n 's/.*state: wrote .* in \([0-9.]*\) s$/\1/p' "$work/$2.log" | head -1)
}

rows=()
row() {
  rows+=("| $1 | $2 | $3 | $4 | $5 |")
  echo "bench-drain: $1: $2 s, $3 B, $4 GB/s ($5)" >&2
}

mkdir -p "$work/a" "$work/b" "$work/b2"
$gen "$model" 0:22 "$work/a" "$size" 2048 >&2
snap=$(stat -c %s "$work/a/kv.snap")
start a "$work/a" 127.0.0.1
pa=$port
row "snapshot load (shard start, plaintext)" "$load_s" "$snap" "$(gbs "$snap" "$load_s")" "start to listening $up_s s"
start b "$work/b" 127.0.0.1
pb=$port
pidb=$pid
drain "$pa" "$pb"
row "drain, plaintext" "$drain_s" "$moved" "$(gbs "$moved" "$drain_s")" "drain command $wall_s s"
stop "$pidb" b
snap=$(stat -c %s "$work/b/kv.snap")
row "snapshot write (SIGTERM, fsync)" "$write_s" "$snap" "$(gbs "$snap" "$write_s")" "signal to exit $stop_s s"
start a2 "$work/b" cn:op a
pa=$port
row "snapshot load (shard start, TLS)" "$load_s" "$snap" "$(gbs "$snap" "$load_s")" "start to listening $up_s s"
start b2 "$work/b2" cn:a b
pb=$port
drain "$pa" "$pb" op
row "drain, mutual TLS 1.3" "$drain_s" "$moved" "$(gbs "$moved" "$drain_s")" "drain command $wall_s s"

echo
echo "KV: $size MiB in sessions of 2048 positions, TinyLlama-1.1B shape (22 layers, 4 KV heads x 64, f16), loopback"
echo
echo "| step | seconds | bytes | GB/s | also |"
echo "|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
echo
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) CPUs"
echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
echo "load average: $load0 at the start, $(cut -d' ' -f1-3 /proc/loadavg) at the end"
