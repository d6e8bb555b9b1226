#!/usr/bin/env bash
# bench-startup.sh — start to ready of `kvshard serve` (to its "listening on port" line, printed once
# the model is loaded and its digest known) with --digest-cache off, a cache miss and a cache hit,
# next to llama-server's (to GET /health answering 200) on the same files, two runs.
#
# Usage: LLAMA_SERVER=/path/llama.cpp/build/bin/llama-server bash scripts/bench-startup.sh FILE.gguf...
#   (run from the repository root; KVSHARD=build/kvshard; LLAMA_SERVER unset: kvshard only)
set -u
K=${KVSHARD:-build/kvshard}
L=${LLAMA_SERVER:-}
[ -x "$K" ] || { echo "bench-startup: no kvshard binary at '$K'" >&2; exit 1; }
[ $# -gt 0 ] || { echo "usage: LLAMA_SERVER=... bash scripts/bench-startup.sh FILE.gguf..." >&2; exit 2; }
work=$(mktemp -d /tmp/kvs-startup.XXXXXX)
trap 'rm -rf "$work"' EXIT
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }
kv() { # FILE CACHE: seconds to "listening on port" (bounded: 300 s)
    local t0 p
    t0=$(now)
    "$K" serve -m "$1" --layers 0:end --listen 127.0.0.1:0 -t 2 --digest-cache "$2" >/dev/null 2>"$work/kv.log" &
    p=$!
    for _ in $(seq 1 6000); do grep -q "listening on port" "$work/kv.log" && break; kill -0 $p 2>/dev/null || break; sleep 0.05; done
    since "$t0"
    kill $p 2>/dev/null; wait $p 2>/dev/null
}
ls_() { # FILE: seconds to /health 200 (bounded: 300 s)
    [ -n "$L" ] || { echo "-"; return; }
    local port=$((20000 + RANDOM % 20000)) t0 p
    t0=$(now)
    LD_LIBRARY_PATH=$(dirname "$L") "$L" -m "$1" --host 127.0.0.1 --port $port -t 2 -c 2048 >/dev/null 2>"$work/ls.log" &
    p=$!
    for _ in $(seq 1 6000); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; kill -0 $p 2>/dev/null || break; sleep 0.05; done
    since "$t0"
    kill $p 2>/dev/null; wait $p 2>/dev/null
}
echo "bench-startup: $(date -u +%FT%TZ) cpu: $(lscpu | sed -n 's/^Model name: *//p' | head -1); load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "| file | kvshard, cache off | cache miss | cache hit | llama-server run 1 / 2 |"
echo "|---|---|---|---|---|"
for f in "$@"; do
    rm -rf "$work/cache"
    echo "| $(basename "$f") | $(kv "$f" off) | $(kv "$f" "$work/cache") | $(kv "$f" "$work/cache") | $(ls_ "$f") / $(ls_ "$f") |"
done
