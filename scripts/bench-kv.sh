#!/usr/bin/env bash
# bench-kv.sh — the hot KV capacity figures of BENCHMARKS.md ("Hot KV capacity"), on a
# TinyLlama-1.1B-shape file (kvshard mkmodel; outside the repository):
#
#  1. per KV type (f16, q8_0, q4_0): bytes per position, sessions of CTX positions per GiB of
#     budget, and decode tok/s after PP and after DEPTH positions — kvshard bench --depth --kv-type
#     next to llama.cpp's llama-batched-bench -ctk T -ctv T -fa on (S_TG at -npp PP and DEPTH),
#     in alternating rounds;
#  2. shared prefix blocks: one shard (every layer) and `kvshard generate`: a cold session on a
#     COMMON-token prompt plus OWN tokens of its own, then a warm one sharing the COMMON tokens
#     (prefill ms of each: the time to the first token), then SESSIONS kept sessions of the same
#     shape, and the KV bytes they hold (kv.bytes_used) against what they hold unshared.
#
# Settings (defaults): KVSHARD=build/kvshard  SCRATCH=/tmp/kvshard-anchors  WEIGHTS=q4_0
#   SHAPE=tinyllama-1.1b (kvshard mkmodel --shape; file SCRATCH/SHAPE-WEIGHTS.gguf)
#   KV_TYPES="f16 q8_0 q4_0"  ROUNDS=2  THREADS=2  PP=128  TG=32  DEPTH=2016  CTX=2048
#   LLAMA_BATCHED_BENCH=/path/llama.cpp/build/bin/llama-batched-bench (unset: kvshard only)
#   COMMON=1024  OWN=64  SESSIONS=32 (PREFIX=0: no part 2)
#
# Usage: bash scripts/bench-kv.sh        (run from the repository root)
set -euo pipefail

KVSHARD=${KVSHARD:-build/kvshard}
SCRATCH=${SCRATCH:-/tmp/kvshard-anchors}
WEIGHTS=${WEIGHTS:-q4_0}
SHAPE=${SHAPE:-tinyllama-1.1b}
KV_TYPES=${KV_TYPES:-f16 q8_0 q4_0}
ROUNDS=${ROUNDS:-2}
THREADS=${THREADS:-2}
PP=${PP:-128}
TG=${TG:-32}
DEPTH=${DEPTH:-2016}
CTX=${CTX:-2048}
COMMON=${COMMON:-1024}
OWN=${OWN:-64}
SESSIONS=${SESSIONS:-32}
PREFIX=${PREFIX:-1}
LLAMA_BATCHED_BENCH=${LLAMA_BATCHED_BENCH:-}

die() { echo "bench-kv: $*" >&2; exit 1; }
[ -x "$KVSHARD" ] || die "no kvshard binary at '$KVSHARD' (build first or set KVSHARD)"
[ -z "$LLAMA_BATCHED_BENCH" ] || [ -x "$LLAMA_BATCHED_BENCH" ] || die "LLAMA_BATCHED_BENCH='$LLAMA_BATCHED_BENCH' is not an executable"
. "$(dirname "$0")/bench_common.sh"
bench_scratch "$SCRATCH" log-kv
prefix=$SHAPE
[ "$SHAPE" = tinyllama-1.1b ] && prefix=tinyllama # bench-anchors.sh's file name
model="$scratch/$prefix-$WEIGHTS.gguf"
if [ ! -s "$model" ]; then
    echo "bench-kv: making $model" >&2
    "$KVSHARD" mkmodel -o "$model" --shape "$SHAPE" --type "$WEIGHTS" --seed 1 -q
fi
n_layer=$("$KVSHARD" inspect "$model" | sed -n 's/^[a-z0-9]*\.block_count = \([0-9]*\)$/\1/p' | head -1)
[ -n "$n_layer" ] || die "cannot read the layer count of $model"

jnum() { sed -n "s/.*\"$1\":\([-0-9.eE+]*\).*/\1/p" "$2" | head -1; }
# S_TG of llama-batched-bench's table row for -npp $2 (| PP | TG | B | N_KV | T_PP | S_PP | T_TG | S_TG |).
bb_tg() { awk -F'|' -v pp="$2" '$2 + 0 == pp && $4 + 0 == 1 { gsub(/ /, "", $9); print $9; exit }' "$1"; }

echo "bench-kv: $(date -u +%FT%TZ) cpu: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) CPUs;" \
     "load average: $(cut -d' ' -f1-3 /proc/loadavg); commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')" >&2

echo "## KV types ($model, weights $WEIGHTS, $THREADS threads; decode tok/s after $PP / after $DEPTH positions)"
echo "| KV type | round | bytes/position | sessions of $CTX per GiB | kvshard $PP / $DEPTH | slowdown | llama.cpp $PP / $DEPTH | slowdown |"
echo "|---|---|---|---|---|---|---|---|"
for ((r = 1; r <= ROUNDS; r++)); do
    for t in $KV_TYPES; do
        o="$log/kvshard-$t-r$r.json"
        kv() { "$KVSHARD" bench -m "$model" -t "$THREADS" -p "$PP" -n "$TG" --depth "$DEPTH" --kv-type "$t" > "$o" 2> "$log/kvshard-$t-r$r.err"; }
        lc() {
            [ -n "$LLAMA_BATCHED_BENCH" ] || return 0
            "$LLAMA_BATCHED_BENCH" -m "$model" -t "$THREADS" -c $((DEPTH + TG + 256)) -b 2048 -ub 512 -npp "$PP,$DEPTH" \
                -ntg "$TG" -npl 1 -ctk "$t" -ctv "$t" -fa on > "$log/llama-$t-r$r.txt" 2> "$log/llama-$t-r$r.err" || true
        }
        if ((r % 2)); then kv; lc; else lc; kv; fi # alternate which engine runs first
        bpp=$(jnum kv_bytes_per_token "$o")
        blk=$(jnum kv_block_bytes "$o")
        per_gib=$(awk -v b="$blk" -v c="$CTX" -v bpp="$bpp" 'BEGIN { bl = b / bpp; n = int((c + bl - 1) / bl); printf "%d", 1073741824 / (n * b) }')
        a=$(jnum decode_tok_s "$o")
        d=$(jnum decode_depth_tok_s "$o")
        s=$(jnum depth_slowdown "$o")
        la="-" ld="-" ls="-"
        if [ -s "$log/llama-$t-r$r.txt" ]; then
            la=$(bb_tg "$log/llama-$t-r$r.txt" "$PP")
            ld=$(bb_tg "$log/llama-$t-r$r.txt" "$DEPTH")
            ls=$(awk -v a="$la" -v d="$ld" 'BEGIN { if (a + 0 > 0 && d + 0 > 0) printf "%.3f", a / d; else print "-" }')
        fi
        echo "| $t | $r | $bpp | $per_gib | $a / $d | $s | ${la:--} / ${ld:--} | $ls |"
    done
done

[ "$PREFIX" = 1 ] || exit 0

# Part 2: a prompt of COMMON shared words, then OWN words of each session's own: mkmodel's vocab
# has "a", "b", .. "zz", "aaa".. as single tokens (about n_vocab / 2 of them; fewer on tiny shapes).
words() { awk -v from="$1" -v n="$2" 'BEGIN { for (i = from; i < from + n; i++) {
    w = ""; k = i + 1; while (k > 0) { k--; w = sprintf("%c", 97 + k % 26) w; k = int(k / 26) } printf "%s ", w } }'; }
common=$(words 0 "$COMMON")
srvlog="$log/serve.log"
"$KVSHARD" serve -m "$model" --layers "0:$n_layer" --listen 127.0.0.1:0 -t "$THREADS" --kv-budget 4G \
    --max-sessions $((SESSIONS + 8)) > "$srvlog" 2>&1 &
srv=$!
trap 'kill $srv 2>/dev/null || true' EXIT
port=""
for _ in $(seq 1 600); do
    port=$(sed -n 's/.*listening on port \([0-9]*\).*/\1/p' "$srvlog" | head -1)
    [ -n "$port" ] && break
    kill -0 $srv 2>/dev/null || die "serve exited: $(tail -3 "$srvlog")"
    sleep 0.1
done
[ -n "$port" ] || die "serve did not listen within 60 s"
gen() { # name own-offset [--keep-session]
    "$KVSHARD" generate --route "127.0.0.1:$port" -p "$common$(words $((COMMON + $2 * OWN)) "$OWN")" -n 1 --temp 0 \
        --stats ${3:-} > /dev/null 2> "$log/gen-$1.err"
    tail -1 "$log/gen-$1.err"
}
stat() { "$KVSHARD" stats "127.0.0.1:$port" | sed -n "s/.*\"$1\":\([0-9]*\).*/\1/p"; }
cold=$(gen cold 0)
warm=$(gen warm 1)
echo
echo "## Shared prefix blocks ($COMMON common + $OWN own prompt words, KV f16)"
echo "| session | prompt tokens | prefill ms (time to first token) |"
echo "|---|---|---|"
echo "| cold | $(echo "$cold" | sed -n 's/.*"prompt_tokens":\([0-9]*\).*/\1/p') | $(echo "$cold" | sed -n 's/.*"prefill_ms":\([0-9.]*\).*/\1/p') |"
echo "| warm | $(echo "$warm" | sed -n 's/.*"prompt_tokens":\([0-9]*\).*/\1/p') | $(echo "$warm" | sed -n 's/.*"prefill_ms":\([0-9.]*\).*/\1/p') |"
for ((i = 0; i < SESSIONS; i++)); do gen "kept-$i" $((i + 2)) --keep-session > "$log/kept-$i.stats"; done
used=$(stat kv.bytes_used)
blk=$(stat kv.block_bytes)
cached=$(stat kv.cached_bytes)
positions=$(sed -n 's/.*"positions":\([0-9]*\).*/\1/p' "$log/kept-0.stats")
echo
own=$((positions - COMMON - 1)) # the BOS and the common words are shared
[ "$own" = "$OWN" ] || echo "bench-kv: note: $positions positions, not 1 + $COMMON + $OWN: the vocab splits some words" >&2
goal=$(((COMMON + SESSIONS * own) * blk / 16 + SESSIONS * blk))
echo "$SESSIONS kept sessions of $positions positions each ($blk bytes a 16-position block):"
echo "| held (kv.bytes_used) | unshared | the issue's bound: ($COMMON + $SESSIONS x $own) positions + a block each | held / bound | cached, unreferenced |"
echo "|---|---|---|---|---|"
echo "| $used | $((SESSIONS * ((positions + 15) / 16) * blk)) | $goal | $(awk -v a="$used" -v b="$goal" 'BEGIN { printf "%.3f", a / b }') | $cached |"
